"""Each site's training script (FLARE's Client API): receive the global model, train on the site's digits, send the
change. The audit attacks the update this script's one local epoch sends, through the job's filters."""
import nvflare.client as flare
import torch
import torch.nn.functional as F
from net import Net
from sklearn.datasets import load_digits


def main() -> None:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    flare.init()
    site = int(flare.get_site_name().rsplit("-", 1)[-1])
    x, y = x[site - 1::2], y[site - 1::2]
    net = Net()
    while flare.is_running():
        model = flare.receive()
        net.load_state_dict(model.params)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        for i in range(0, len(x), 32):
            optimizer.zero_grad()
            F.cross_entropy(net(x[i:i + 32]), y[i:i + 32]).backward()
            optimizer.step()
        flare.send(flare.FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": len(x) // 32 + 1}))


if __name__ == "__main__":
    main()
