"""The app's model, data and training, as Flower's PyTorch quickstart (``flwr new --framework pytorch``) writes
them today: the quickstart's ``Net``, ``train`` with SGD and momentum 0.9, ``test``, ``load_data`` giving dict
batches ``{"img", "label"}`` normalised by (0.5, 0.5), and ``load_centralized_dataset`` for the server's
``evaluate_fn``. Only the data is swapped for an offline stand-in: scikit-learn's digits at 32 x 32 in three
channels, a held-out set for the server and IID partitions of the rest (the quickstart downloads CIFAR-10)."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import Compose, Normalize

BATCH_SIZE = 32
IMAGES = int(os.environ.get("FLOWER_APP_IMAGES", "0")) or None  # each partition's size cap (the tests: small)
RUNS = os.environ.get("FLOWER_APP_RUNS", "runs/flower_app")  # where the audits write
ITERATIONS = int(os.environ.get("FLOWER_APP_ITERATIONS", "300"))  # the attack's budget


class Net(nn.Module):
    """The quickstart's CNN (LeNet-like, 32 x 32 RGB in, 10 classes out)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Partition(Dataset):
    """One client's images as the quickstart's Hugging Face partition gives them: ``{"img", "label"}`` items
    through ``transform``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"img": self.transform(self.images[i]), "label": int(self.labels[i])}


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", antialias=True).clamp(0, 1).expand(-1, 3, -1, -1)
    return x.contiguous(), torch.tensor(digits.target)


TRANSFORM = Compose([Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
HELD_OUT = 297  # the server's test images (the quickstart's: CIFAR-10's test split)


def _order() -> torch.Tensor:
    return torch.randperm(1797, generator=torch.Generator().manual_seed(42))  # the digits, in a fixed order


def load_data(partition_id: int, num_partitions: int, batch_size: int = BATCH_SIZE) -> tuple[DataLoader, DataLoader]:
    """Partition ``partition_id`` of ``num_partitions`` of the images the server does not hold out: 80% to train
    on (shuffled, in batches of ``batch_size``), 20% to test; ``IMAGES`` caps its size (the quickstart's is
    CIFAR-10's share, 5,000 for 10)."""
    x, y = _digits()
    mine = _order()[HELD_OUT:][partition_id::num_partitions][:IMAGES]
    cut = int(0.8 * len(mine))
    train = Partition(x[mine[:cut]], y[mine[:cut]], TRANSFORM)
    test = Partition(x[mine[cut:]], y[mine[cut:]], TRANSFORM)
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size=batch_size)


def load_centralized_dataset() -> DataLoader:
    """The server's own test set, which no client trains on (the server's ``evaluate_fn`` reads it)."""
    x, y = _digits()
    held = _order()[:HELD_OUT]
    return DataLoader(Partition(x[held], y[held], TRANSFORM), batch_size=128)


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """The quickstart's local training: SGD at ``lr`` with momentum 0.9 for ``epochs`` passes; the mean training
    loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images, labels = batch["img"].to(device), batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net: nn.Module, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """The quickstart's evaluation: mean loss and accuracy."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images, labels = batch["img"].to(device), batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
