"""What an audit is made of, built from its sections: its data and its models at training step 0.

The runner's ``Scenario`` builds from here, and so does ``attacks: auto``, which must see the models an audit
attacks to choose the attacks that apply to them.
"""
from __future__ import annotations

import torch
from torch import nn

from leakaudit.attacks.vectorised import free_memory
from leakaudit.evaluator.audit.seeds import derive_seed
from leakaudit.evaluator.audit.types import Audit, ConfigError, DataSection, DefenseSetting, ModelSection, as_dict
from leakaudit.evaluator.zoo.models import build_model
from leakaudit.plugins.components import ImageData
from leakaudit.plugins.defense import Defense
from leakaudit.plugins.text import TokenData
from leakaudit.plugins.factories import call_with_accepted, import_factory


def load_data(audit: Audit) -> ImageData | TokenData:
    """The audit's images: its registered dataset or its ``data.factory``; a loader's failure as one ConfigError
    line that names the source."""
    section = audit.data
    try:
        if section.factory is not None:
            return load_factory_data(section, audit)
        assert section.dataset is not None, "the checks keep exactly one of dataset and factory"
        spec = audit.registry.get("dataset", section.dataset)
        return spec.load(image_size=section.image_size, root=section.root, download=section.download,
                         **section.params)
    except ConfigError:
        raise
    except Exception as exc:
        source = f"factory {section.factory}" if section.factory else f"dataset {section.dataset}"
        root = f" from {section.root}" if section.root else ""
        raise ConfigError([f"{audit.path}: data: {source} could not be loaded{root}: {one_line(exc)}"]) from None


def load_factory_data(section: DataSection, audit: Audit) -> ImageData | TokenData:
    """Call the user's ``data.factory`` and check it returned an ``ImageData``; a ConfigError otherwise."""
    assert section.factory is not None, "called for a data.factory"
    offered = {"image_size": section.image_size, "root": section.root, "download": section.download}
    data = call_with_accepted(import_factory(section.factory), offered, section.params)
    if not isinstance(data, (ImageData, TokenData)):
        raise ConfigError([f"{audit.path}: data.factory: {section.factory} returned {type(data).__name__}; "
                           "return leakaudit.ImageData(name, train_x, train_y, test_x, test_y, num_classes) "
                           "with images in [0, 1] as (N, C, H, W) float tensors"])
    return data


def model_section(audit: Audit, setting: DefenseSetting | None = None) -> ModelSection:
    """The ``model:`` section a setting uses: its own, or the audit's."""
    return audit.model if setting is None or setting.model is None else setting.model


def initial_model(audit: Audit, data: ImageData | TokenData, defense: Defense, setting: DefenseSetting | None,
                  device: torch.device) -> nn.Module:
    """The model at training step 0 under ``defense``, on ``device``: the same initialisation for every
    setting of one model section (the setting's own, else the audit's)."""
    m = model_section(audit, setting)
    assert m.name is not None, "the checks name every model (a factory by its path)"
    spec = m.name if ":" in m.name else audit.registry.get("model", m.name)
    if isinstance(data, TokenData):
        model = build_model(spec, {"vocab_size": data.vocab_size, "num_classes": data.num_classes,
                                   "length": data.length}, m.params, derive_seed(audit.seed, "init"))
    else:
        model = build_model(spec, {"channels": data.channels, "num_classes": data.num_classes,
                                   "image_size": audit.data.image_size}, m.params, derive_seed(audit.seed, "init"))
    with torch.random.fork_rng(devices=[]):  # layers a defense adds are initialised from the audit seed
        torch.manual_seed(derive_seed(audit.seed, "wrap"))
        return defense.wrap_model(model).to(device)


def check_data_memory(audit: Audit) -> None:
    """Refuse an ``image_size`` whose images would take more than half the available memory (estimated from
    the images the loader keeps, as float32 at that size), before loading them. Made once, by the process that
    checks the audit: a worker that loads the audit again later is not refused for memory the run now uses."""
    section = audit.data
    spec = None if section.factory or section.dataset is None else audit.registry.get("dataset", section.dataset)
    if spec is None or spec.values is None:
        return
    need = 4 * spec.values(as_dict(section)) * section.image_size ** 2
    limit = free_memory(torch.device("cpu")) // 2
    if need > limit:
        raise ConfigError([f"{audit.path}: data.image_size: {section.image_size} needs about {need / 2 ** 30:.1f} "
                           f"GiB for the images of {section.dataset} at that size, more than half the available "
                           f"memory ({limit / 2 ** 30:.1f} GiB); lower image_size or the images kept"])


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
