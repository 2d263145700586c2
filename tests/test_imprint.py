"""The malicious server of Fowl et al. 2022: an imprint block in front of the model, whose gradients give back
individual images exactly, from one client's update or from the mean of many under secure aggregation."""
from __future__ import annotations

import pytest
import json

import torch
import torch.nn.functional as F
from torch import nn

from leakaudit.attacks.imprint import Imprint, ImprintBlock, binned_images
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.jobs import job_at
from leakaudit.evaluator.results.rundir import RunFolder
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.plugins.protocol import FedAvg, FedSGD, fedavg_update

PHOTOS = {"dataset": "photos", "image_size": 32, "targets": 64, "batch_size": 64}


def test_each_image_alone_in_a_bin_comes_back_exactly():
    torch.manual_seed(0)
    block = ImprintBlock(1, 8, 256)
    model = nn.Sequential(block, nn.Flatten(), nn.Linear(64, 10))
    images, labels = torch.randn(6, 1, 8, 8), torch.arange(6)
    grads = torch.autograd.grad(F.cross_entropy(model(images), labels), [block.measure.weight, block.measure.bias])
    found = binned_images(*grads, 6)
    thresholds = -block.measure.bias
    bins = torch.searchsorted(thresholds, block.measure.weight[0] @ images.flatten(1).T)
    alone = [i for i in range(6) if (bins == bins[i]).sum() == 1 and bins[i] > 0]
    assert len(alone) >= 5
    for i in alone:  # each isolated image is one of the rows read out, to float precision
        assert (found - images[i].flatten()).abs().amax(dim=1).min() < 1e-4


def test_the_attack_needs_the_block_and_reads_several_local_steps():
    attack = Imprint()
    assert "imprint block" in attack.unsupported(nn.Linear(4, 2), 4, FedSGD())
    model = nn.Sequential(ImprintBlock(1, 4, 8), nn.Flatten(), nn.Linear(16, 2))
    assert attack.unsupported(model, 64, FedAvg(clients=16)) is None
    assert attack.unsupported(model, 64, FedAvg(clients=16, local_batch_size=1)) is None


@pytest.mark.parametrize("local_lr, least, most", [(0.01, 12, 16), (1.0, 0, 2)])
def test_four_local_steps_give_images_back_at_a_small_learning_rate_only(local_lr, least, most):
    """FedAvg's four minibatch steps move the block between its gradients: at local_lr 0.01 the bins still read
    the images (measured: 14 of 16 above 30 dB), at 1.0 none of them (measured: 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(ImprintBlock(1, 8, 256), nn.Flatten(), nn.Linear(64, 10))
    images, labels = torch.randn(16, 1, 8, 8), torch.arange(16) % 10
    update = fedavg_update(model, F.cross_entropy, images, labels, FedAvg(local_batch_size=4, local_lr=local_lr))
    found = binned_images(update[0], update[1], 16)
    mse = torch.cdist(images.flatten(1), found).min(dim=1).values ** 2 / 64
    psnr = 10 * torch.log10((images.amax() - images.amin()) ** 2 / mse)
    assert least <= int((psnr > 30).sum()) <= most


def _audit(write_audit, tmp_path, name: str, **changes) -> dict:
    audit = {"name": name, "seed": 0, "device": "cpu", "data": PHOTOS,
             "model": {"name": "imprint", "params": {"base": "lenet_zhu"}, "checkpoints": [0]},
             "threat": {"known_labels": True}, "defenses": [{"name": "none"}], "attacks": [{"name": "imprint"}],
             "utility": {"train_steps": 0}, "metrics": ["psnr"], **changes}
    out = tmp_path / name
    run_audit(load_audit(write_audit(audit, f"{name}.yaml")), out, progress=False)
    return {r["setting"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_the_mean_of_16_clients_gives_back_most_of_their_64_images(write_audit, tmp_path):
    rows = _audit(write_audit, tmp_path, "robbed", protocol={"name": "fedavg", "clients": 16, "local_lr": 0.1})
    psnr = rows["none"]["per_image"]["psnr"]
    assert sum(p > 30 for p in psnr) > 32  # measured: 57 of 64 (1,024 bins), most of them exact (over 70 dB)
    html = (tmp_path / "robbed" / "report.html").read_text()
    assert "malicious: the server sent a model with an imprint block" in html


@pytest.mark.slow
def test_dp_sgd_leaves_no_image_above_the_mean_image_guess(write_audit, tmp_path):
    """One DP-SGD step, noise multiplier 1 (1-GDP, about epsilon 4.4 at delta 1e-5), each example clipped to 1."""
    dp = {"name": "dpsgd", "params": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}
    rows = _audit(write_audit, tmp_path, "dp", defenses=[dp])
    folder = RunFolder(tmp_path / "dp", load_audit(tmp_path / "dp" / "audit.yaml"))
    defended = rows["dpsgd(max_grad_norm=1.0,noise_multiplier=1.0)"]
    saved = folder.load_reconstruction(job_at(folder.audit, defended["setting"], "imprint", 0, 0))
    originals = saved["original"]
    mean_image = folder.audit.registry.get("dataset", "photos").load(image_size=32, root=None,
                                                                      download=False).train_x.mean(0)
    guess = -10 * torch.log10(((originals - mean_image) ** 2).flatten(1).mean(1))
    psnr = torch.tensor(defended["per_image"]["psnr"])
    assert (psnr < guess + 1.0).all()  # measured: at most 20.1 dB, none beyond its guess
    assert sum(p > 30 for p in rows["none"]["per_image"]["psnr"]) > 32  # the same server, undefended
