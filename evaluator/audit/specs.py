"""The audit file's keys: each section's declared parameters (types, ranges, defaults, help) and the bounds
that keep a run finite. The loader, ``leakaudit plugins`` and the JSON Schema all read these tables."""
from __future__ import annotations

from leakaudit.plugins.spec import Param


#: The metrics an audit measures where ``metrics:`` is left out, and the one that ranks attacks among them.
DEFAULT_METRICS = ["psnr", "ssim", "mse", "lpips", "label_accuracy"]
DEFAULT_LEAKAGE_METRIC = "psnr"
#: The metrics of an audit of text (token sequences) where ``metrics:`` is left out; the first ranks the attacks.
DEFAULT_TEXT_METRICS = ["rouge1", "rouge2", "rougeL", "token_accuracy", "label_accuracy"]
#: Training steps an audit may ask for (checkpoints, utility.train_steps): past this a run is a hang, not an audit.
MAX_STEPS = 100_000
#: Private images an audit may attack: past this a run is a hang, not an audit.
MAX_TARGETS = 100_000
#: Audit files larger than this are refused unread; YAML aliases may expand to at most this many values.
MAX_FILE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
#: Problems listed one per line; the rest are counted.
MAX_PROBLEMS_SHOWN = 20
MAX_LINE = 400

TOP = {
    "name": Param(type=str, help="audit name, shown in reports"),
    "seed": Param(0, int, min=0, help="seed of every random draw"),
    "device": Param("auto", str, choices=("auto", "cpu", "cuda"), help="where attacks and training run: auto (cuda when a GPU is visible, else cpu)"),
    "deterministic": Param(True, bool, help="on CUDA, deterministic kernels: the same numbers on every run, "
                                            "several times slower (false: faster, reruns differ slightly)"),
    "compile": Param(False, bool, help="run the attacks' vectorised iterations through torch.compile, on CUDA "
                                       "replayed as CUDA graphs: faster once a first compilation per model shape, "
                                       "attack and chunk size is paid (docs/results.md, Speed); a CPU needs a C++ "
                                       "compiler"),
    "precision": Param("float32", str, choices=("float32", "bfloat16"),
                       help="the attacks' vectorised iterations: bfloat16 runs the model's forward and double "
                            "backward under autocast (the images and Adam's state stay float32); it weakens the "
                            "attacks (6-7 dB on the quickstart, docs/results.md), so it is for speed checks, not "
                            "verdicts"),
    "workers": Param(None, int, min=1, help="worker processes (default: auto: one per visible GPU on CUDA; on the "
                                            "CPU, one per core, but no more than the settings and cells to run "
                                            "nor than their work pays process starts for: a small audit runs in "
                                            "this process alone)"),
    "executor": Param("local", (str, dict), help="local (worker processes on this machine) or ray (tasks on a Ray "
                                                 "cluster), or a mapping: {name: ray, address: auto, ...}"),
    "max_problems": Param("auto", (str, int), help="problems (targets x restarts x tuning trials) an attack "
                                                   "optimises together: auto (what fits in free memory) or a number"),
    "plugins_dir": Param(None, str, help="folder of drop-in *.py plugins, relative to this file"),
    "data": Param(type=dict, help="the private examples attacked and the training data (the data section)"),
    "model": Param(type=dict, help="the network the clients train and the steps it is attacked at (the model section)"),
    "defenses": Param(type=list, help="the settings compared: each a defense, its params, a sweep, a chain or a "
                                      "frontier search"),
    "attacks": Param("auto", (str, list),
                     help="the attacks: a list of {name: ...} entries, or auto (the default: every registered "
                          "attack that applies to the audit's models, defenses and batch sizes, at budgets for "
                          "the device; leakaudit validate lists the choice)"),
    "utility": Param({}, dict, help="the training that measures what each defense costs in accuracy"),
    "metrics": Param(list(DEFAULT_METRICS), list, help="the scores of each reconstruction (the data's modality decides the default)"),
    "leakage_metric": Param(None, str, help="the metric that ranks attacks and draws the privacy axis "
                                            "(default: psnr when measured, else the first of metrics)"),
    "threat": Param({}, dict, help="what the attacker is given beside the update"),
    "protocol": Param("fedsgd", (str, dict), help="fedsgd | fedavg | step, or a mapping with their settings"),
    "verdict": Param({}, dict, help="thresholds of the report's verdicts (evaluator/results/verdict.py)"),
    "budget": Param(None, (str, int, float), help="the wall time the audit may take on this machine, like 90s, 10m "
                                                  "or 1h: attacks: auto and tuning fit it (the cheapest attacks "
                                                  "first, the others' iterations scaled down or left out; a "
                                                  "step's attacks stop once its verdict is settled) and the report "
                                                  "says what it cut (default: none; run --budget overrides it)"),
    "architecture": Param("auto", (str, bool), choices=("auto", True, False),
                          help="the report's architecture analysis (Chen & Campbell 2022: each convolution's "
                               "linear system and its rank): auto (when an attack of the audit solves those "
                               "systems), true or false; its exact ranks can take seconds per model"),
}
EXECUTOR = {
    "name": Param("local", str, choices=("local", "ray"), help="local worker processes, or tasks on a Ray cluster"),
    "address": Param(None, str, help="the Ray cluster to join: auto (the one this machine is part of) or "
                                     "ray://HOST:10001; left out: RAY_ADDRESS, else a Ray started on this machine"),
    "num_cpus": Param(1.0, float, min=0.0, exclusive_min=True, help="CPUs each Ray task asks for"),
    "num_gpus": Param(None, float, min=0.0, help="GPUs each Ray task asks for (default: 1 with device cuda, else 0)"),
    "max_retries": Param(3, int, min=0, help="times Ray reruns a task whose worker process or node died"),
}
DATA = {
    "dataset": Param(None, str, help="a registered dataset (leakaudit plugins)"),
    "factory": Param(None, str, help="'package.module:load' returning your own ImageData (instead of dataset)"),
    "image_size": Param(32, int, min=8, max=512, help="side of the square images in pixels (image datasets)"),
    "targets": Param(4, int, min=1, max=MAX_TARGETS, help="private examples attacked (images or sentences)"),
    "target_split": Param("test", str, choices=("test", "train"),
                          help="the split the targets come from: test (never trained on) or train (also trained "
                               "on, as Balunovic et al. 2022 attack the first 100 training images)"),
    "target_order": Param("random", str, choices=("random", "first"),
                          help="a seeded draw of the split, or its first images in the dataset's own order"),
    "batch_size": Param(1, int, min=1, help="examples per shared update"),
    "root": Param(None, str, help="folder of the dataset's files (torchvision's datasets and imagefolder)"),
    "download": Param(False, bool, help="let torchvision download a missing dataset into root (audits never do "
                                        "otherwise)"),
    "params": Param({}, dict, help="the dataset's own settings (leakaudit plugins lists them)"),
}
MODEL = {"name": Param(None, str, help="a zoo model (leakaudit plugins)"),
         "factory": Param(None, str, help="'package.module:build' returning your own nn.Module (instead of name)"),
         "params": Param({}, dict, help="the model's own settings (leakaudit plugins lists them)"),
         "checkpoints": Param([0], list, help="training steps at which the update is attacked (0: untrained)"),
         "mode": Param("train", str, choices=("train", "eval"),
                       help="the mode the client's update is computed (and attacked) in: train (BatchNorm batch "
                            "statistics) or eval (running statistics, as Geiping et al.'s and Balunovic et al.'s "
                            "code attack)")}
DEFENSE = {"name": Param(None, str, help="a registered defense (leakaudit plugins)"),
           "params": Param({}, dict, help="the defense's settings"),
           "sweep": Param({}, dict, help="{param: [values]}: one setting per value"),
           "label": Param(None, str, help="the setting's name in the report (default: the defense and its params)"),
           "chain": Param(None, list, help="defenses applied in order, each {name, params, sweep}"),
           "model": Param(None, dict, help="this entry's own model {name or factory, params} (default: model)"),
           "clients": Param(None, (int, list), help="secure aggregation: the server sees the mean of this many "
                                                    "clients' updates (a list: one setting each), each client holding "
                                                    "data.batch_size / protocol.clients images (protocol fedavg)"),
           "must_protect": Param(False, bool, help="run --fail-on-leak exits with status 3 when a setting of this "
                                                   "entry leaks"),
           "frontier": Param(None, dict, help="search, instead of a sweep, for the weakest setting that protects: "
                                              "{param, range: [low, high], tolerance, probes}")}
FRONTIER = {"param": Param(type=str, help="the defense's monotone knob (a parameter declared with protects)"),
            "range": Param(type=list, help="[low, high]: the values searched between, both ends probed"),
            "tolerance": Param(1.25, float, min=1.0, exclusive_min=True,
                               help="stop once the weakest protecting value and the strongest leaking one are "
                                    "within this factor"),
            "probes": Param(8, int, min=2, max=64, help="the most settings the search judges, both ends included")}
SETTING_MODEL = {k: p for k, p in MODEL.items() if k != "checkpoints"}
MEMBER = {"name": Param(type=str, help="a registered defense applied at this place of the chain"),
          "params": Param({}, dict, help="its settings"),
          "sweep": Param({}, dict, help="{param: [values]}: one setting per value")}
ROLES = ("naive", "adaptive")
ATTACK = {"name": Param(type=str, help="a registered attack (leakaudit plugins)"),
          "params": Param({}, dict, help="the attack's settings (its budget, priors, step size)"),
          "label": Param(None, str, help="the attack's name in the report (two entries of one attack need one)"),
          "tune": Param(None, dict, help="budgeted hyperparameter search before attacking (evaluator/audit/tuning.py)"),
          "defenses": Param(None, list, help="run only on settings with a defense (or chain member) of these "
                                             "names, or with these labels"),
          "checkpoints": Param(None, list, help="run only at these of model.checkpoints (e.g. a prior weight for the "
                                                "untrained model and another for the trained one)"),
          "role": Param(None, str, choices=ROLES, help="how the report counts it (default: adaptive when the "
                                                       "attack uses what the defense does)")}
UTILITY = {
    "train_steps": Param(200, int, min=0, max=MAX_STEPS, help="SGD steps of utility training under the defense"),
    "batch_size": Param(32, int, min=1, help="examples per utility training step"),
    "lr": Param(0.1, float, min=0.0, exclusive_min=True, help="SGD's step size in utility training"),
    "momentum": Param(0.0, float, min=0.0, max=1.0, help="SGD's momentum in utility training"),
    "delta": Param(1e-5, float, min=0.0, max=1.0, exclusive_min=True,
                   help="delta at which epsilon is reported for defenses with a formal guarantee"),
    "max_drop": Param(0.05, float, min=0.0, max=1.0,
                      help="usable where the test accuracy is at most this far under the undefended model's (and "
                           "above chance plus verdict.utility_margin); verdict.min_accuracy overrides both"),
    "train_defended": Param(True, bool, help="train under the defense; false: plain SGD on clean updates, the "
                                             "defense only on the attacked update (Balunovic et al. 2022's "
                                             "setting); accuracy is then the clean model's, and no epsilon"),
}
STATISTICS = ("mean", "ci_bound")
VERDICT = {
    "margin": Param(None, float, min=0.0, help="how far the strongest attack must beat the better guess made "
                                               "without the gradient to leak, in the leakage metric's units "
                                               "(default: the metric's: psnr 1 dB, ssim 0.05, mse 0.01, lpips 0.05)"),
    "statistic": Param("mean", str, choices=STATISTICS, help="what is compared with the threshold: the strongest "
                                                             "attack's mean, or the leaking end of its interval"),
    "utility_margin": Param(0.05, float, min=0.0, max=1.0, help="test accuracy above chance (the majority class's "
                                                                 "share) a usable model needs"),
    "min_accuracy": Param(None, float, min=0.0, max=1.0, help="usable from this test accuracy (instead of chance "
                                                              "plus utility_margin)"),
    "identifiable": Param(0.25, float, min=0.0, max=1.0, nullable=True,
                          help="with one image per update, also leaks when an attack's share of reconstructions "
                               "nearest their own original reaches this, beyond chance (null: by the score alone)"),
    "confidence": Param(0.95, float, min=0.5, max=0.999, help="level of the bootstrap intervals and the "
                                                              "identification test"),
    "bootstrap": Param(2000, int, min=100, max=100_000, help="bootstrap resamples per interval"),
}
THREAT = {"known_labels": Param(False, bool, help="the attacker is given the true labels")}

#: What every audit file must hold, for the messages about a file that holds none of it.
TOP_NEEDS = "name, data, model and defenses (see configs/quickstart.yaml)"
