"""Every kind of bad input: exit 2 and one line naming the file and the key, before any work, never a traceback.

Each case is a change to a small valid audit (or a whole file's text) and the start of what the line must
say after ``<file>: ``. ``validate`` answers them; those that need the data or the user's code are given
to ``run``, which checks them before its first job. A fuzz test throws random mappings at ``validate``.
"""
from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leakaudit.evaluator.cli import main

from conftest import small_audit


def _with(path: str, value, base: dict | None = None) -> dict:
    """``base`` (the small audit) with the value at a dotted path (list indices as numbers) replaced;
    ``...`` as the value deletes the key."""
    audit = copy.deepcopy(base or small_audit())
    *parents, last = path.split(".")
    node = audit
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    elif value is ...:
        del node[last]
    else:
        node[last] = value
    return audit


IG = "attacks.0.params"
GAUSS = {"name": "gaussian", "params": {"sigma": 0.1}}

#: (change, the line's start after "<file>: ")
CASES = [
    # top level
    (_with("name", ...), "name: required parameter is missing"),
    (_with("name", 3), "name: 3 is not of type str"),
    (_with("seed", -1), "seed: -1 is below the minimum 0"),
    (_with("seed", 1.5), "seed: 1.5 is not of type int"),
    (_with("seed", "zero"), "seed: 'zero' is not of type int"),
    (_with("seed", True), "seed: True is not of type int"),
    (_with("device", "tpu"), "device: 'tpu' is not one of the choices"),
    (_with("device", "cuda"), "device: 'cuda' but no CUDA device"),
    (_with("deterministic", "yes"), "deterministic: 'yes' is not of type bool"),
    (_with("compile", "yes"), "compile: 'yes' is not of type bool"),
    (_with("defenses", [{"name": "qsgd", "params": {"levels": 0}}]), "defenses[0].params.levels: 0 is below the minimum 1"),
    (_with("workers", 0), "workers: 0 is below the minimum 1"),
    (_with("workers", "two"), "workers: 'two' is not of type int"),
    (_with("architecture", "sometimes"), "architecture: 'sometimes' is not one of the choices; choices: auto, true, false"),
    (_with("protocol", {"name": "fedavg", "clients": 0}), "protocol.clients: 0 is below the minimum 1"),
    (_with("defenses", [{"name": "signsgd", "params": {"scaled": 1}}]),
     "defenses[0].params.scaled: 1 is not of type bool"),
    (_with("defenses", [{"name": "none", "clients": "four"}]), "defenses[0].clients: 'four' is not of type"),
    (_with("attacks", [{"name": "bayes", "params": {"signed": "yes"}}]),
     "attacks[0].params.signed: 'yes' is not of type bool"),
    (_with("max_problems", 0), "max_problems: 0 is neither 'auto' nor"),
    (_with("max_problems", "all"), "max_problems: 'all' is neither 'auto' nor"),
    (_with("max_problems", 2.5), "max_problems: 2.5 is not of type str or int"),
    (_with("colour", "red"), "colour: unknown parameter"),
    (_with("atacks", []), "atacks: unknown parameter (did you mean 'attacks'?)"),
    (_with("plugins_dir", "nowhere"), "plugins_dir: "),
    (_with("leakage_metric", "lpips"), "leakage_metric: 'lpips' is not one of this audit's metrics"),
    (_with("leakage_metric", 3), "leakage_metric: 3 is not of type str"),
    # data
    (_with("data", ...), "data: required parameter is missing"),
    (_with("data", "digits"), "data: 'digits' is not of type dict"),
    (_with("data", [1]), "data: [1] is not of type dict"),
    (_with("data.dataset", "digitz"), "data.dataset: 'digitz' is not a registered dataset (did you mean 'digits'?)"),
    (_with("data.dataset", ["digits"]), "data.dataset: ['digits'] is not of type str"),
    (_with("data.dataset", ...), "data: give exactly one of dataset or factory"),
    (_with("data.factory", "loader:load"), "data: give exactly one of dataset or factory (both given)"),
    (_with("data.datset", 1), "data.datset: unknown parameter (did you mean 'dataset'?)"),
    (_with("data.image_size", 4), "data.image_size: 4 is below the minimum 8"),
    (_with("data.image_size", 1024), "data.image_size: 1024 is above the maximum 512"),
    (_with("data.image_size", "big"), "data.image_size: 'big' is not of type int"),
    (_with("data.targets", 0), "data.targets: 0 is below the minimum 1"),
    (_with("data.batch_size", 0), "data.batch_size: 0 is below the minimum 1"),
    (_with("data.batch_size", 3), "data.targets: 2 is not a multiple of data.batch_size 3"),
    (_with("data.download", "yes"), "data.download: 'yes' is not of type bool"),
    (_with("data.target_split", "val"), "data.target_split: 'val' is not one of the choices; choices: test, train"),
    (_with("data.target_order", "last"), "data.target_order: 'last' is not one of the choices; choices: random, first"),
    (_with("data.params", {"crops": 3}), "data.params.crops: unknown parameter"),
    (_with("data", {"dataset": "photos", "params": {"crops": 0}, "targets": 2}), "data.params.crops: 0 is below"),
    (_with("data", {"dataset": "cifar10", "targets": 2}), "data.root: dataset 'cifar10' needs a root folder"),
    (_with("data", {"dataset": "cifar10", "root": "/nonexistent/x", "targets": 2}), "data.root: folder /nonexistent/x"),
    (_with("data", {"dataset": "imagefolder", "root": "/nonexistent/x", "targets": 2}),
     "data.root: folder /nonexistent/x does not exist; put train/<class>/ and test/<class>/ (image files, one "
     "subfolder per class) there"),
    (_with("data", {"dataset": "imagefolder", "root": "/nonexistent/x", "targets": 2, "download": True}),
     "data.download: dataset 'imagefolder' reads your own folders and has nothing to download; remove download: "
     "true"),
    (_with("data", {"factory": "no_such_module_x:load", "targets": 2}), "data.factory: cannot import module"),
    (_with("data", {"factory": "nocolon", "targets": 2}), "data.factory: 'nocolon' is not of the form"),
    (_with("data", {"factory": "math:pi", "targets": 2}), "data.factory: 'math:pi' is a float, not a function"),
    (_with("data", {"factory": "math:nothing_here", "targets": 2}), "data.factory: module 'math' has no attribute"),
    (_with("data.targets", 400), "data.targets: 400 targets requested but the data has only"),
    (_with("data", {"dataset": "photos", "params": {"crops": 10 ** 6}, "image_size": 512, "targets": 2}),
     "data.image_size: 512 needs about 20507.8 GiB for the images of photos at that size, more than half the "
     "available memory"),
    # model
    (_with("model", ...), "model: required parameter is missing"),
    (_with("model", "lenet_zhu"), "model: 'lenet_zhu' is not of type dict"),
    (_with("model.name", "lenet"), "model.name: 'lenet' is not a registered model"),
    (_with("model.name", "lenet_zhuu"), "model.name: 'lenet_zhuu' is not a registered model or a 'package.module:factory' "
                                        "(did you mean 'lenet_zhu'?)"),
    (_with("model.name", ...), "model: give exactly one of name or factory"),
    (_with("model.name", ["lenet_zhu"]), "model.name: ['lenet_zhu'] is not of type str"),
    (_with("model.params", {"width": 3}), "model.params.width: unknown parameter"),
    (_with("model.params", 3), "model.params: 3 is not of type dict"),
    (_with("model.checkpoints", [0, -3]), "model.checkpoints[1]: -3 is not a training step"),
    (_with("model.checkpoints", [0, 0]), "model.checkpoints: [0, 0] repeats a step"),
    (_with("model.checkpoints", [0, "end"]), "model.checkpoints[1]: 'end' is not a training step"),
    (_with("model.checkpoints", [10 ** 9]), "model.checkpoints[0]: 1000000000 is past the 100000 training steps"),
    (_with("model.checkpoints", 5), "model.checkpoints: 5 is not of type list"),
    (_with("model.mode", "inference"), "model.mode: 'inference' is not one of the choices; choices: train, eval"),
    (_with("defenses.1", {**GAUSS, "model": {"name": "lenet_zhu", "mode": "test"}}),
     "defenses[1].model.mode: 'test' is not one of the choices; choices: train, eval"),
    (_with("model.factory", "math:pi", _with("model.name", ...)), "model.factory: 'math:pi' is a float"),
    (_with("model.factory", "no_such_module_x:build", _with("model.name", ...)), "model.factory: cannot import module"),
    # defenses
    (_with("defenses", ...), "defenses: required parameter is missing"),
    (_with("defenses", []), "defenses: expected a non-empty list"),
    (_with("defenses", {"name": "none"}), "defenses: {'name': 'none'} is not of type list"),
    (_with("defenses.0", 7), "defenses[0]: expected a mapping, got int"),
    (_with("defenses.1", "gausian"), "defenses[1].name: 'gausian' is not a registered defense (did you mean 'gaussian'?)"),
    (_with("defenses.1", {"name": "gausian"}), "defenses[1].name: 'gausian' is not a registered defense "
                                               "(did you mean 'gaussian'?)"),
    (_with("defenses.1", {"name": ["gaussian"]}), "defenses[1].name: ['gaussian'] is not of type str"),
    (_with("defenses.1", {"params": {"sigma": 1}}), "defenses[1]: name is required"),
    (_with("defenses.1", {"name": "gaussian", "params": {"sigma": -1}}), "defenses[1].params.sigma: -1 must be greater than 0"),
    (_with("defenses.1", {"name": "gaussian", "params": {"sigma": ".nan"}}), "defenses[1].params.sigma: '.nan' is not of type"),
    (_with("defenses.1", {"name": "gaussian", "params": {"sigma": float("nan")}}), "defenses[1].params.sigma: nan is not a finite"),
    (_with("defenses.1", {"name": "gaussian", "params": {"sigma": float("inf")}}), "defenses[1].params.sigma: inf is not a finite"),
    (_with("defenses.1", {"name": "gaussian", "params": {"sigmma": 1}}), "defenses[1].params.sigmma: unknown parameter "
                                                                         "(did you mean 'sigma'?)"),
    (_with("defenses.1", {"name": "gaussian", "sweep": {"sigma": []}}), "defenses[1].sweep.sigma: expected a non-empty list"),
    (_with("defenses.1", {"name": "gaussian", "sweep": {"sigma": 0.1}}), "defenses[1].sweep.sigma: expected a non-empty list"),
    (_with("defenses.1", {"name": "gaussian", "sweep": {"sigma": [0.1, -1]}}), "defenses[1].sweep.sigma[1]: -1 must be"),
    (_with("defenses.1", {**GAUSS, "sweep": {"scale": [1]}}), "defenses[1].sweep.scale: unknown parameter"),
    (_with("defenses.1", {**GAUSS, "sweep": {"sigma": [0.1, 1.0]}}),
     "defenses[1].sweep.sigma: given twice, in defenses[1].params and in defenses[1].sweep; keep one: params for one "
     "value, sweep for a list of them"),
    (_with("defenses.1", {"name": "gaussian", "sweep": {"sigmaa": [0.1, 1.0]}}),
     "defenses[1].sweep.sigmaa: unknown parameter (did you mean 'sigma'?); choices: sigma"),
    (_with("defenses.1", {"name": "prune", "frontier": {"param": "scale", "range": [0.1, 1.0]}}),
     "defenses[1]: prune(scale=0.1): prune: scale 0.1 is the noise's scale and noise is 'none'; set noise: "
     "gaussian or laplace"),
    (_with("defenses.1", {"name": "none"}), "defenses[1]: setting none appears twice"),
    (_with("defenses.1", {"name": "gaussian", "chain": [GAUSS]}), "defenses[1]: give either name"),
    (_with("defenses.1", {"chain": [GAUSS, {"name": "gausian"}]}), "defenses[1].chain[1].name: 'gausian'"),
    (_with("defenses.1", {"chain": "gaussian"}), "defenses[1].chain: 'gaussian' is not of type list"),
    (_with("defenses.1", {"name": "gaussian", "label": 3}), "defenses[1].label: 3 is not of type str"),
    (_with("defenses.1", {**GAUSS, "model": {"name": "lenett"}}), "defenses[1].model.name: 'lenett'"),
    (_with("defenses.1", {"name": "soteria", "params": {"layer": "nope"}}), "defenses: soteria(layer=nope): "),
    # attacks
    (_with("attacks", "every"), "attacks: expected auto or a list of {name: ...} entries, got 'every'"),
    (_with("attacks", []), "attacks: expected a non-empty list"),
    (_with("attacks.0", {"name": "inverting_gradient"}), "attacks[0].name: 'inverting_gradient' is not a registered "
                                                         "attack (did you mean 'inverting_gradients'?)"),
    (_with("attacks.0", {"params": {}}), "attacks[0].name: required parameter is missing"),
    (_with(f"{IG}.iterations", 0), "attacks[0].params.iterations: 0 is below the minimum 1"),
    (_with(f"{IG}.iterations", 10 ** 12), "attacks[0].params.iterations: 1000000000000 is above the maximum 1000000"),
    (_with("data.targets", 10 ** 9), "data.targets: 1000000000 is above the maximum 100000"),
    (_with("defenses.1", {"chain": []}), "defenses[1].chain: an empty chain; list the defenses applied in order"),
    (_with("model.checkpoints", []), "model.checkpoints: an empty list; give the training steps to attack at"),
    (_with("attacks.0.defenses", ["gausian"]), "attacks[0].defenses: 'gausian' is not a registered defense or a "
                                               "setting label (did you mean 'gaussian'?)"),
    (_with("protocol", {"nmae": "fedavg"}), "protocol.nmae: unknown key (did you mean 'name'?)"),
    (_with(f"{IG}.iterations", 1.5), "attacks[0].params.iterations: 1.5 is not of type int"),
    (_with(f"{IG}.lr", 0), "attacks[0].params.lr: 0 must be greater than 0.0"),
    (_with(f"{IG}.step", 3), "attacks[0].params.step: unknown parameter"),
    (_with(f"{IG}.priors", {"tv": float("nan")}), "attacks[0].params: prior 'tv': weight nan must be a finite number"),
    (_with(f"{IG}.priors", {"tv": float("inf")}), "attacks[0].params: prior 'tv': weight inf must be a finite number"),
    (_with(f"{IG}.priors", {"tv": -1}), "attacks[0].params: prior 'tv': weight -1 must be"),
    (_with(f"{IG}.priors", {"smooth": 1}), "attacks[0].params: unknown prior 'smooth'"),
    (_with(f"{IG}.label_method", "guess"), "attacks[0].params.label_method: 'guess' is not one of the choices"),
    (_with("attacks.0.role", "strong"), "attacks[0].role: 'strong' is not one of the choices"),
    (_with("attacks.0.defenses", ["nope"]), "attacks[0].defenses: 'nope' is not a registered defense or a setting label"),
    (_with("attacks.0.defenses", []), "attacks[0].defenses: expected a non-empty list"),
    (_with("attacks.0.defenses", ["soteria"]), "attacks[0].defenses: no setting of this audit uses soteria"),
    (_with("attacks.0.checkpoints", [100]), "attacks[0].checkpoints: expected a non-empty list of steps from "
                                            "model.checkpoints, got [100]; choices: 0"),
    (_with("attacks.0.checkpoints", []), "attacks[0].checkpoints: expected a non-empty list of steps"),
    (_with("attacks.0.checkpoints", 0), "attacks[0].checkpoints: 0 is not of type list"),
    (_with("model", {"name": "convnet", "params": {"activation": "tanh"}}),
     "model.params.activation: 'tanh' is not one of the choices; choices: relu, sigmoid"),
    (_with("model", {"name": "resnet18", "params": {"stem": "vit"}}),
     "model.params.stem: 'vit' is not one of the choices; choices: auto, cifar, imagenet"),
    (_with("attacks.0", {"name": "cinet", "params": {"channels": 64}}),
     "attacks[0].params.channels: unknown parameter"),
    (_with("model", {"name": "imprint", "params": {"base": "vgg"}}),
     "model.params.base: 'vgg' is not one of the choices; choices: lenet_zhu, convnet"),
    (_with("model", {"name": "imprint", "params": {"bins": 1}}), "model.params.bins: 1 is below the minimum 2"),
    (_with("attacks", [{"name": "imprint"}]),
     "attacks[0]: imprint reads the gradients of an imprint block the malicious server places in front of"),
    (_with("protocol", {"name": "fedavg", "local_batch_size": 1}, _with(
        "data", {"dataset": "digits", "image_size": 16, "targets": 4, "batch_size": 4},
        _with("attacks", [{"name": "ares"}], _with("model", {"name": "ares"})))),
     "attacks[0]: ares needs each client's update to be one gradient step (fedavg takes 4 local steps here"),
    (_with("model", {"name": "ares", "params": {"base": "resnet18"}}),
     "model.params.base: 'resnet18' is not one of the choices; choices: cnn_bayes, convbig, mlp"),
    (_with("model", {"name": "ares", "params": {"layer": 2}}),
     "model: ares: IndexError: params.layer: 2: ARES imprints fully connected layer 2 and needs one after it; the model has 2"),
    (_with("attacks", [{"name": "ares"}]),
     "attacks[0]: ares reads a fully connected layer whose weights a malicious server crafted (Gong et al. 2026)"),
    (_with("attacks", [{"name": "spear", "params": {"samples": 0}}]),
     "attacks[0].params.samples: 0 is below the minimum 1"),
    (_with("attacks", [{"name": "spear", "params": {"label_method": "votes"}}]),
     "attacks[0].params.label_method: 'votes' is not one of the choices; choices: inputs, auto, signs"),
    (_with("attacks", [{"name": "cocktail_party", "params": {"contrast": "tanh"}}]),
     "attacks[0].params.contrast: 'tanh' is not one of the choices; choices: logcosh, exp, cube"),
    (_with("attacks", [{"name": "learning_to_invert", "params": {"updates": 8}}]),
     "attacks[0].params.updates: 8 is below the minimum 16"),
    (_with("attacks", [{"name": "spear"}]),
     "attacks[0]: spear: the model's first layer with parameters must be fully connected"),
    (_with("attacks.0.tune", {"budget": 0, "space": {"lr": [0.01, 0.1]}}), "attacks[0].tune.budget: "),
    (_with("attacks.0.tune", {"budget": 2, "space": {"nope": [1, 2]}}), "attacks[0].tune.space.nope: "),
    (_with("attacks.1", {"name": "inverting_gradients"}, _with("attacks", [{"name": "inverting_gradients"}, None])),
     "attacks[1].label: attack label 'inverting_gradients' is used twice"),
    # utility, threat, protocol, metrics
    (_with("utility.train_steps", -1), "utility.train_steps: -1 is below the minimum 0"),
    (_with("utility.train_steps", 10 ** 9), "utility.train_steps: 1000000000 is above the maximum 100000"),
    (_with("utility.lr", 0), "utility.lr: 0 must be greater than 0.0"),
    (_with("utility.momentum", 2), "utility.momentum: 2 is above the maximum 1.0"),
    (_with("utility.delta", 0), "utility.delta: 0 must be greater than 0.0"),
    (_with("utility.epochs", 3), "utility.epochs: unknown parameter"),
    (_with("utility.train_defended", "no"), "utility.train_defended: 'no' is not of type bool"),
    (_with("utility", 5), "utility: 5 is not of type dict"),
    (_with("threat.known_labels", "yes"), "threat.known_labels: 'yes' is not of type bool"),
    (_with("threat.labels", True), "threat.labels: unknown parameter"),
    (_with("protocol", "fedsdg"), "protocol.name: 'fedsdg' is not a protocol (did you mean 'fedsgd'?)"),
    (_with("protocol", {"name": ["fedsgd"]}), "protocol.name: ['fedsgd'] is not a protocol"),
    (_with("protocol", {"name": "fedavg", "local_epochs": 0}), "protocol.local_epochs: 0 is below the minimum 1"),
    (_with("protocol", {"name": "fedsgd", "local_epochs": 2}), "protocol.local_epochs: only applies to protocol fedavg"),
    (_with("protocol", {"name": "fedavg", "shuffle": "yes"}), "protocol.shuffle: 'yes' is not of type bool"),
    (_with("protocol", {"name": "step", "lr": 0.1}), "protocol.function: required for protocol step"),
    (_with("protocol", {"name": "step", "function": "math:pi", "lr": 0.1}), "protocol.function: 'math:pi' is a float"),
    (_with("protocol", 3), "protocol: 3 is not of type str or dict"),
    (_with("metrics", "psnr"), "metrics: 'psnr' is not of type list"),
    (_with("metrics", []), "metrics: expected a non-empty list"),
    (_with("metrics", ["psnr", "fid"]), "metrics[1]: 'fid' is not a registered metric"),
    (_with("metrics", ["psnrr"]), "metrics[0]: 'psnrr' is not a registered metric (did you mean 'psnr'?)"),
    (_with("metrics", [["psnr"]]), "metrics[0]: expected the name of a metric, got ['psnr']"),
    (_with("metrics", ["psnr", "lpips"]), "metrics[1]: lpips needs images of at least"),
    (_with("attacks.0", {"name": "cos", "params": {"layer_weights": "linear"}}),
     "attacks[0].params.layer_weights: 'linear' is not one of the choices; choices: equal, exp"),
    (_with("attacks.0", {"name": "bayes", "params": {"layer_weights": "exp"}}),
     "attacks[0].params.layer_weights: unknown parameter"),
    # verdict thresholds and the gate's marks
    (_with("verdict.statistic", "median"), "verdict.statistic: 'median' is not one of the choices; choices: mean, "
                                           "ci_bound"),
    (_with("verdict.margin", -1.0), "verdict.margin: -1.0 is below the minimum 0.0"),
    (_with("verdict.confidence", 1.5), "verdict.confidence: 1.5 is above the maximum 0.999"),
    (_with("verdict.bootstrap", 10), "verdict.bootstrap: 10 is below the minimum 100"),
    (_with("verdict.min_accuracy", 2), "verdict.min_accuracy: 2 is above the maximum 1.0"),
    (_with("verdict.identifiable", 1.5), "verdict.identifiable: 1.5 is above the maximum 1.0"),
    (_with("verdict.utility_margin", -0.1), "verdict.utility_margin: -0.1 is below the minimum 0.0"),
    (_with("verdict.threshold", 3), "verdict.threshold: unknown parameter"),
    (_with("verdict", "strict"), "verdict: 'strict' is not of type dict"),
    (_with("defenses.1.must_protect", "yes"), "defenses[1].must_protect: 'yes' is not of type bool"),
]

#: Whole files: (text, the line's start after "<file>: ")
TEXTS = [
    ("", "the file is empty; an audit needs name, data, model and defenses"),
    ("# only a comment\n", "the file is empty"),
    ("- name: a\n- name: b\n", "the file holds a list; an audit is a mapping"),
    ("just text\n", "the file holds a str; an audit is a mapping"),
    ("name: [unclosed\n", "line 1: the '[' opened here is not closed; end it with ']'"),
    ("name: a\n  bad: indent\n", "line 2: 'bad: indent' is indented deeper than 'name: a' on line 1, which already "
                                  "has a value"),
    ("name: a\ndata:\n  dataset: digits\n targets: 2\n", "line 4: 'targets: 2' is indented 1 space, which lines up "
                                                          "with no key or list above it ('dataset: digits' on line 3 "
                                                          "has its key at 2)"),
    ("defenses:\n  - name: none\n  params: {}\n", "line 3: 'params: {}' is indented 2 spaces, which lines up with no "
                                                 "key or list above it ('- name: none' on line 2 has its dash at 2, "
                                                 "its keys at 4)"),
    ("name: a\ndata\n  dataset: digits\n", "line 2: 'data' is a key without a ':' after it; write 'data:'"),
    ("name: a\ndata:\n\tdataset: digits\n", "line 3: a tab in the indentation; YAML indents with spaces only"),
    ("name: 'a\nseed: 1\n", "line 1: the quote opened here is not closed"),
    ("name: a: b\n", "line 1: 'name: a: b' holds a second ': ' in one value; put the value in quotes"),
    ("name: a\nseed: 0\nseed: 7\n", "line 3: not valid YAML: key 'seed' appears twice (first at line 2); keep one"),
    ("name: a\ndata: {dataset: digits, dataset: lfw}\n", "line 2: not valid YAML: key 'dataset' appears twice"),
    ("name: !!python/object:os.system x\n", "line 1: not valid YAML"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
     "its aliases expand to more than 100000 values"),
]


def _one_line(capsys, path) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"leakaudit: error: {path}: "), err
    return lines[0].removeprefix(f"leakaudit: error: {path}: ")


@pytest.mark.parametrize("audit, expected", CASES, ids=[e[:50] for _, e in CASES])
def test_a_bad_audit_is_one_line_and_exit_2(audit, expected, write_audit, tmp_path, capsys):
    path = write_audit(audit)
    code = main(["validate", str(path)])
    if code == 0:  # needs the data or the user's code: the run checks it before any work
        capsys.readouterr()
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"])
        assert not (tmp_path / "out" / "results.jsonl").exists()
    assert code == 2
    assert _one_line(capsys, path).startswith(expected)


@pytest.mark.parametrize("text, expected", TEXTS, ids=[e[:40] for _, e in TEXTS])
def test_a_bad_file_is_one_line_and_exit_2(text, expected, tmp_path, capsys):
    path = tmp_path / "audit.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    assert _one_line(capsys, path).startswith(expected)


def test_files_that_are_not_audit_files(tmp_path, capsys):
    folder, binary, huge = tmp_path / "folder.yaml", tmp_path / "binary.yaml", tmp_path / "huge.yaml"
    folder.mkdir()
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    huge.write_text("name: a\n" + "# padding\n" * 200_000)
    for path, expected in [(folder, "is a folder; give the audit's YAML file"),
                           (binary, "not a text file (byte 0 is not UTF-8); give the audit's YAML file"),
                           (huge, "2000008 bytes; an audit file is at most 1048576 bytes"),
                           (tmp_path / "missing.yaml", "file not found")]:
        assert main(["validate", str(path)]) == 2
        assert _one_line(capsys, path) == expected


def test_a_nul_byte_and_a_pipe_are_one_line(tmp_path, capsys):
    import os

    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"name: a\x00\n")
    assert main(["validate", str(nul)]) == 2
    assert _one_line(capsys, nul).startswith("character 7: not valid YAML: special characters are not allowed")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert main(["validate", str(fifo)]) == 2
    assert _one_line(capsys, fifo) == "not a regular file (a pipe or device); give the audit's YAML file"


@pytest.mark.parametrize("module, code, expected", [
    ("quits", "import sys\nsys.exit(0)\n", "it called sys.exit(0) at import"),
    ("fails", "raise RuntimeError('no\\nluck')\n", "RuntimeError: no luck")])
def test_user_code_that_exits_or_fails_at_import_is_named(write_audit, tmp_path, capsys, module, code, expected):
    (tmp_path / f"{module}.py").write_text(code)
    path = write_audit(_with("model", {"factory": f"{module}:build", "checkpoints": [0]}))
    assert main(["validate", str(path)]) == 0  # found, not imported: validate runs no code of the user's
    capsys.readouterr()
    assert main(["validate", str(path), "--import"]) == 2
    assert _one_line(capsys, path) == f"model.factory: cannot import module '{module}': {expected}"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{module}.py").write_text(code)
    path = write_audit(_with("plugins_dir", "plugins"))
    assert main(["validate", str(path)]) == 2
    assert _one_line(capsys, path).endswith(f"{module}.py failed to load: {expected}")


def _attack_plugin(tmp_path, name: str, body: str):
    """A drop-in folder with one attack plugin: Inverting Gradients named ``name``, with ``body`` in its class."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{name}.py").write_text(
        "import leakaudit\nfrom leakaudit.attacks.gradient_matching import InvertingGradients\n\n"
        f"class Plugin(InvertingGradients):\n    name = {name!r}\n\n{body}\n"
        "@leakaudit.hookimpl\ndef register_attacks():\n    return [Plugin]\n")
    return plugins


def test_a_plugin_constructor_that_raises_is_named(write_audit, tmp_path, capsys):
    plugins = _attack_plugin(tmp_path, "broken", "    def __init__(self, **settings):\n"
                                                 "        raise RuntimeError('cannot start')\n")
    path = write_audit(_with("attacks", [{"name": "broken"}], _with("plugins_dir", "plugins")))
    assert main(["validate", str(path)]) == 2
    assert _one_line(capsys, path) == (f"attacks[0].params: attack 'broken' (file:{plugins / 'broken.py'}) raised "
                                       "RuntimeError: cannot start")


def test_a_plugins_dir_that_is_a_file_is_one_line(write_audit, tmp_path, capsys):
    (tmp_path / "plugins.py").write_text("")
    path = write_audit(_with("plugins_dir", "plugins.py"))
    assert main(["validate", str(path)]) == 2
    line = _one_line(capsys, path)
    assert line.startswith("plugins_dir: plugins folder ")
    assert line.endswith("is a file; give the folder that holds the plugin *.py files")


@pytest.mark.parametrize("argv, expected", [
    (["frobnicate"], "leakaudit: error: argument command: invalid choice: 'frobnicate'"),
    (["run", "a.yaml"], "leakaudit: error: the following arguments are required: --out (see leakaudit run --help)"),
    (["run", "a.yaml", "--out", "x", "--workers", "two"], "leakaudit: error: argument --workers: invalid int value")])
def test_argparse_errors_are_one_line_with_a_hint(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(expected) and "--help)" in err[0]


def test_many_problems_are_capped_with_a_count(write_audit, capsys):
    path = write_audit(small_audit(defenses=[{"name": f"nope{i}"} for i in range(30)]))
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 21 and lines[-1] == "leakaudit: error: ... and 10 more problems"


def test_validate_calls_no_factory_unless_import_where_it_checks_as_run_does(write_audit, tmp_path, capsys):
    (tmp_path / "side_effect.py").write_text(
        "from pathlib import Path\n\ndef build(**_):\n    Path(__file__).with_name('called').write_text('x')\n")
    path = write_audit(_with("model", {"factory": "side_effect:build", "checkpoints": [0]}))
    assert main(["validate", str(path)]) == 0
    assert not (tmp_path / "called").exists()
    assert "user code found on the import path, not imported: `validate --import` imports them and checks the " \
           "names: side_effect:build" in capsys.readouterr().out
    refused = "model: side_effect:build: TypeError: model factory 'side_effect:build' returned NoneType, not a " \
              "torch.nn.Module"
    assert main(["validate", str(path), "--import"]) == 2 and (tmp_path / "called").exists()
    assert _one_line(capsys, path) == refused
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert _one_line(capsys, path) == refused


def test_validate_import_lists_the_runs_attacks_and_estimates_a_factory_model(write_audit, tmp_path, capsys,
                                                                                monkeypatch):
    """A CNN of the user's: auto's list is the one run chooses on the built model (no analytic, no SPEAR), and the
    estimate is made of it, not skipped."""
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run import estimate

    (tmp_path / "tiny_cnn.py").write_text(
        "from torch import nn\n\ndef build(num_classes=10):\n    return nn.Sequential(nn.Conv2d(1, 4, 5, padding=2), "
        "nn.Sigmoid(), nn.Flatten(), nn.Linear(4 * 16 * 16, num_classes))\n")
    path = write_audit({**_with("model", {"factory": "tiny_cnn:build", "checkpoints": [0]}), "attacks": "auto"})
    estimated = []

    class Stub:
        def lines(self):
            return ["estimated time on this machine: stub"]

    monkeypatch.setenv("LEAKAUDIT_ESTIMATE", "1")
    monkeypatch.setattr(estimate, "plan_and_estimate", lambda audit, workers=None: estimated.append(
        [a.name for a in audit.attacks]) or Stub())
    assert main(["validate", str(path), "--import"]) == 0
    chosen = [a.name for a in load_audit(path).attacks]  # what run loads
    out = capsys.readouterr().out
    assert "analytic" not in chosen and "spear" not in chosen and estimated == [chosen]
    assert f"attacks: auto chose {len(chosen)} of " in out and "  estimated time on this machine: stub" in out
    assert main(["validate", str(path)]) == 0  # without --import: neither, and it says why
    out = capsys.readouterr().out
    assert "your model is not built here" in out and "time: not estimated here" in out and len(estimated) == 1


def test_validate_runs_no_user_code_at_import_unless_asked(write_audit, tmp_path, capsys):
    """What a CI gate runs on a pull request's audit file: a module that writes at import is found, not run."""
    (tmp_path / "writes.py").write_text("from pathlib import Path\nPath(__file__).with_name('ran').write_text('x')\n"
                                        "def step(model, inputs, labels):\n    pass\n")
    path = write_audit(_with("protocol", {"name": "step", "function": "writes:step", "lr": 0.1}))
    assert main(["validate", str(path)]) == 0 and not (tmp_path / "ran").exists()
    assert main(["validate", str(path), "--import"]) == 0 and (tmp_path / "ran").exists()  # as run imports it
    path = write_audit(_with("protocol", {"name": "step", "function": "nowhere_at_all.mod:step", "lr": 0.1}))
    assert main(["validate", str(path)]) == 2
    assert _one_line(capsys, path) == ("protocol.function: cannot import module 'nowhere_at_all.mod': "
                                       "'nowhere_at_all' is not found on the import path (the audit file's folder is "
                                       "on it)")


def test_a_torchvision_root_without_the_dataset_is_one_line(write_audit, tmp_path, capsys):
    root = tmp_path / "empty"
    root.mkdir()
    path = write_audit(_with("data", {"dataset": "cifar10", "root": str(root), "targets": 2}))
    assert main(["validate", str(path)]) == 2
    assert _one_line(capsys, path) == (f"data.root: folder {root} has no cifar-10-batches-py/; put cifar-10-batches-py/ "
                                       "there, or set download: true")


@pytest.mark.slow
def test_a_setting_label_is_cosmetic(write_audit, tmp_path):
    """Renaming a setting's label leaves its numbers as they were: its streams derive from what it is."""
    import json

    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.runner import run_audit

    psnr = {}
    for label in ("first", "renamed"):
        audit = small_audit(defenses=[{"name": "gaussian", "params": {"sigma": 0.1}, "label": label}],
                            utility={"train_steps": 0})
        out = tmp_path / label
        run_audit(load_audit(write_audit(audit, name=f"{label}.yaml")), out, progress=False)
        psnr[label] = [json.loads(r)["psnr"] for r in (out / "results.jsonl").read_text().splitlines()]
    assert psnr["first"] == psnr["renamed"]


KEYS = st.sampled_from(["name", "seed", "device", "workers", "data", "model", "defenses", "attacks", "utility",
                        "metrics", "threat", "protocol", "max_problems", "leakage_metric", "dataset", "params",
                        "sweep", "chain", "label", "tune", "image_size", "targets", "checkpoints", "sigma"])
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10 ** 6) | st.floats(allow_nan=True) | st.text(max_size=12)
    | st.sampled_from(["digits", "lenet_zhu", "gaussian", "inverting_gradients", "psnr", "fedavg", "auto"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5), max_leaves=25)


#: Random mappings, and the small audit with one of its keys (or a key inside a section) replaced at random.
MAPPINGS = st.dictionaries(KEYS, VALUES, max_size=8) | st.builds(
    lambda key, value: {**small_audit(), key: value}, st.sampled_from(sorted(small_audit())), VALUES) | st.builds(
    lambda section, key, value: {**small_audit(), section: {**small_audit()[section], key: value}},
    st.sampled_from(["data", "model", "utility"]), KEYS, VALUES)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MAPPINGS)
def test_validate_never_lets_a_traceback_escape(tmp_path, capsys, mapping):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(mapping))
    assert main(["validate", str(path)]) in (0, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert all(line.startswith("leakaudit: error: ") for line in err.strip().splitlines())


def test_a_step_function_of_the_wrong_signature_is_one_line_before_any_work(write_audit, tmp_path, capsys):
    (tmp_path / "mystep.py").write_text("def step(model, batch):\n    pass\n")
    path = write_audit(_with("protocol", {"name": "step", "function": "mystep:step", "lr": 0.1}))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert _one_line(capsys, path) == ("protocol.function: mystep:step takes (model, batch); leakaudit calls it as "
                                       "function(model, inputs, labels)")


def test_an_attack_failing_mid_run_is_named_and_the_rows_before_it_kept(write_audit, tmp_path, capsys):
    plugins = _attack_plugin(tmp_path, "flaky", "    @classmethod\n    def reconstruct_all(cls, problems, "
                                                "max_problems=None):\n        raise RuntimeError('lost its way')\n")
    audit = _with("attacks", [{"name": "inverting_gradients", "params": {"iterations": 2}},
                              {"name": "flaky", "params": {"iterations": 2}}], _with("plugins_dir", "plugins"))
    path = write_audit({**audit, "defenses": [{"name": "none"}], "utility": {"train_steps": 0}})
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--no-progress"]) == 4
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"leakaudit: error: attack 'flaky' (file:{plugins / 'flaky.py'}) failed on none, step 0")
    assert line.endswith("RuntimeError: lost its way; the rows already written are kept: fix it and rerun with "
                         "--resume")


def test_a_damaged_or_missing_run_folder_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"leakaudit: error: {tmp_path / 'nowhere'}: no such folder; give a " \
                                              "run's --out folder"
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "audit.yaml").write_text(yaml.safe_dump(small_audit()))
    (folder / "run.json").write_text("{\"sessions\": [")
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"leakaudit: error: {folder / 'run.json'}: damaged (") and len(err.splitlines()) == 1


def test_compile_without_a_cpp_compiler_is_one_line_before_any_work(write_audit, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    path = write_audit(_with("compile", True) | {"device": "cpu"})
    assert main(["validate", str(path)]) == 2
    assert _one_line(capsys, path).startswith("compile: true needs a C++ compiler on a CPU")


def _no_estimate(monkeypatch) -> None:
    """The time estimate asked for, as a user's run asks, and failing the test if it is made."""
    from leakaudit.evaluator.run import estimate

    monkeypatch.setenv("LEAKAUDIT_ESTIMATE", "1")
    monkeypatch.setattr(estimate, "plan_and_estimate", lambda *a, **k: pytest.fail("estimated before the check"))


def test_an_out_folder_name_too_long_is_one_line_naming_out_before_the_estimate(write_audit, tmp_path, capsys,
                                                                                 monkeypatch):
    _no_estimate(monkeypatch)
    path = write_audit(small_audit(defenses=[{"name": "none"}]))
    long = tmp_path / ("r" * 300)
    assert main(["run", str(path), "--out", str(long), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"leakaudit: error: --out: {'r' * 40}...: a folder name of 300 bytes, over the 255 a file system allows; "
        "choose a shorter --out"] and not captured.out


@pytest.mark.parametrize("case, expected", [
    ("held", "already holds a run; pass --resume to continue it"),
    ("changed", "differs from the audit first run in"),
    ("file", "is a file, not a folder; choose a folder"),
])
def test_an_unusable_out_is_one_line_before_the_estimate(case, expected, write_audit, tmp_path, capsys, monkeypatch):
    _no_estimate(monkeypatch)
    path = write_audit(small_audit(defenses=[{"name": "none"}]))
    out = tmp_path / "run"
    if case == "file":
        out.write_text("notes")
    else:
        out.mkdir()
        (out / "audit.yaml").write_text(path.read_text().replace("seed: 0", "seed: 1") if case == "changed"
                                        else path.read_text())
    resume = ["--resume"] if case == "changed" else []
    assert main(["run", str(path), "--out", str(out), "--no-progress", *resume]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("leakaudit: error: --") \
        and not captured.out


def test_more_targets_than_the_test_split_is_one_line_before_the_estimate(write_audit, tmp_path, capsys,
                                                                           monkeypatch):
    _no_estimate(monkeypatch)
    path = write_audit(_with("data.targets", 5000))
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert _one_line(capsys, path).startswith("data.targets: 5000 targets requested but") \
        and not (tmp_path / "run").exists()
