"""ATS (Gao et al. 2021): the client's update is the gradient at its augmented images, and the attack is
scored against those."""
from __future__ import annotations

import pytest
import torch

from leakaudit.defenses.ats import ATS, OPERATIONS, PAPER_POLICIES, apply_operation, parse_policy, random_crop_flip
from leakaudit.defenses.noise import GaussianNoise
from leakaudit.evaluator.audit.config import load_audit
from leakaudit.evaluator.audit.types import ConfigError
from leakaudit.evaluator.run.runner import run_audit
from leakaudit.evaluator.run.scenario import Scenario
from leakaudit.evaluator.run.utility import training_run
from leakaudit.evaluator.zoo.metrics import psnr
from leakaudit.plugins.defense import SharedUpdate

from conftest import small_audit


def test_policies_name_gao_et_al_operations_in_order():
    assert parse_policy("21-13-3+7-4-15") == [[21, 13, 3], [7, 4, 15]]
    assert [OPERATIONS[i] for i in parse_policy(PAPER_POLICIES[0])[0]] == [
        ("translateY", 100 / 993), ("sharpness", 1 / 18), ("brightness", 0.5)]
    assert OPERATIONS[3] == ("translateX", 150 / 331) and OPERATIONS[21] == ("translateX", 250 / 993)
    assert len(OPERATIONS) == 50
    with pytest.raises(ValueError, match="policy '7-4-50': operation 50 does not exist; choose 0..49"):
        parse_policy("7-4-50")
    with pytest.raises(ValueError, match="'7,4' is not a policy"):
        parse_policy("7,4")


def test_operations_move_and_scale_pixels_as_their_magnitudes_say():
    img = torch.zeros(1, 16, 16)
    img[0, 8, 8] = 0.6
    moved = apply_operation(img, "translateX", 150 / 331, 1.0)  # 0.453 of 16 px: 7 px
    assert moved[0, 8, 15] == pytest.approx(0.6) and moved.sum() == pytest.approx(0.6)
    assert apply_operation(img, "translateY", 150 / 331, -1.0)[0, 1, 8] == pytest.approx(0.6)
    assert torch.allclose(apply_operation(img, "brightness", 0.5, 1.0), img * 1.5)
    assert torch.allclose(apply_operation(img, "brightness", 0.5, -1.0), img * 0.5)
    assert apply_operation(img, "solarize", 256 * 5 / 9, 1.0)[0, 8, 8].item() == pytest.approx(0.4)  # 153 >= 142
    assert torch.equal(apply_operation(img, "solarize", 256, 1.0), img)  # threshold 256 inverts nothing
    assert torch.equal(apply_operation(img, "invert", 0, 1.0), 1 - img)
    rand = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    for name, magnitude in set(OPERATIONS):
        out = apply_operation(rand, name, magnitude, -1.0)
        assert out.shape == rand.shape and 0 <= out.min() and out.max() <= 1, name


def test_crop_at_the_padding_is_the_identity_and_flip_mirrors():
    img = torch.rand(3, 8, 8)
    assert torch.equal(random_crop_flip(img, 4, 4, 4, False), img)
    assert torch.equal(random_crop_flip(img, 4, 4, 4, True), img.flip(-1))
    shifted = random_crop_flip(img, 4, 0, 4, False)  # the crop starts 4 rows above the image: its top is padding
    assert torch.equal(shifted[:, 4:], img[:, :4]) and shifted[:, :4].abs().sum() == 0


def test_augment_is_seeded_and_draws_per_image():
    pixels = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ats = ATS(policy="21-13-3+7-4-15")
    a = ats.augment(pixels, torch.Generator().manual_seed(5))
    assert torch.equal(a, ats.augment(pixels, torch.Generator().manual_seed(5)))
    assert not torch.equal(a, ats.augment(pixels, torch.Generator().manual_seed(6)))
    same = ats.augment(pixels[:1].expand(6, -1, -1, -1), torch.Generator().manual_seed(5))
    assert len({tuple(x.flatten()[:64].tolist()) for x in same}) > 1  # one image, different draws
    assert torch.equal(ATS(policy="39", crop_padding=0, flip=False).augment(pixels, torch.Generator()), pixels)


def test_likelihood_is_cosine_only_direction_counts():
    g = [torch.randn(4, 3), torch.randn(5)]
    observed = SharedUpdate(g, ["w", "b"], 1)
    ats = ATS()
    assert ats.log_likelihood(observed, g).item() == pytest.approx(0.0, abs=1e-6)
    assert ats.log_likelihood(observed, [2.5 * t for t in g]).item() == pytest.approx(0.0, abs=1e-6)
    assert ats.log_likelihood(observed, [-t for t in g]).item() == pytest.approx(-2.0, abs=1e-6)
    assert ats.has_likelihood() and ats.augments() and not GaussianNoise(sigma=0.1).augments()


def test_utility_training_draws_augmented_batches(write_audit):
    audit = load_audit(write_audit(small_audit(defenses=[{"name": "ats", "params": {"policy": "21-13-3"}},
                                                         {"name": "none"}])))
    scenario = Scenario(audit)
    ats, none = (scenario.defense(s) for s in audit.settings)
    run = training_run(scenario, audit.settings[0], 3, ats)
    assert training_run(scenario, audit.settings[1], 3, none).transform is None
    x, _ = run.batch()
    pixels = scenario.denormalise(x)
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    run.batch_generator.manual_seed(0)
    drawn = torch.randint(len(run.inputs), (run.batch_size,), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(run.batch()[0], run.inputs[drawn])  # augmented, not the stored images


@pytest.mark.slow
def test_the_attack_rebuilds_and_is_scored_against_the_augmented_image(write_audit, tmp_path):
    audit = load_audit(write_audit(small_audit(
        defenses=[{"name": "ats", "params": {"policy": "21-13-3"}}],
        attacks=[{"name": "dlg", "params": {"iterations": 30, "restarts": 1}}], utility={"train_steps": 0},
        metrics=["psnr"])))
    out = tmp_path / "out"
    run_audit(audit, out, progress=False)
    from leakaudit.evaluator.audit.jobs import AttackJob
    from leakaudit.evaluator.results.rundir import RunFolder
    folder, scenario = RunFolder(out, audit), Scenario(audit)
    for target in range(audit.num_batches):
        saved = folder.load_reconstruction(AttackJob(audit.settings[0], audit.attacks[0], 0, target))
        raw, _ = scenario.target_batch(target)
        assert psnr(saved["reconstruction"], saved["original"]).item() > 30.0  # the augmented image leaks
        assert psnr(saved["original"], raw.cpu()).item() < 15.0  # and it is far from the stored one


def test_a_bad_policy_is_one_line_naming_the_key(write_audit):
    path = write_audit(small_audit(defenses=[{"name": "ats", "params": {"policy": "7-4-99"}}]))
    with pytest.raises(ConfigError) as info:
        load_audit(path)
    (line,) = info.value.lines
    assert line.startswith(f"{path}: defenses[0]") and "operation 99 does not exist; choose 0..49" in line, line
