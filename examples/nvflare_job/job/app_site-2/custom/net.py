"""The model the NVFlare job trains and the audit attacks: a small MLP on 8 x 8 digits (the job's initial_model)."""
from torch import nn


class Net(nn.Sequential):
    """Flatten, 64 hidden units, ReLU, 10 classes: one image of 8 x 8 pixels per row of the input."""

    def __init__(self, image_size: int = 8, num_classes: int = 10) -> None:
        super().__init__(nn.Flatten(), nn.Linear(image_size * image_size, 64), nn.ReLU(), nn.Linear(64, num_classes))
