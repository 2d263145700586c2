"""Reading an audit file safely: size and alias bounds, duplicate keys refused, ``1e-5`` read as a float."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from leakaudit.evaluator.audit.specs import MAX_FILE_BYTES, MAX_YAML_VALUES
from leakaudit.evaluator.audit.types import ConfigError


class AuditLoader(yaml.SafeLoader):
    """YAML 1.1's safe loader that also reads ``1e-5`` as a float, as YAML 1.2 and Python do, and refuses a
    key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen[key] = key_node.start_mark.line
            except TypeError:  # an unhashable key: the constructor reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {first + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _expanded_size(value: Any, seen: dict[int, int]) -> int:
    """Values in ``value`` with every alias expanded (aliases share objects: counted once per object, fast)."""
    if id(value) in seen:
        return seen[id(value)]
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    seen[id(value)] = 1 + sum(_expanded_size(c, seen) for c in children)
    return seen[id(value)]


def read_yaml(path: Path) -> tuple[str, Any]:
    """The file's text and parsed content; a ConfigError when it is missing, too large, not text or not YAML."""
    if path.is_dir():
        raise ConfigError([f"{path}: is a folder; give the audit's YAML file"])
    if path.exists() and not path.is_file():
        raise ConfigError([f"{path}: not a regular file (a pipe or device); give the audit's YAML file"])
    if not path.is_file():
        raise ConfigError([f"{path}: file not found"])
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError([f"{path}: {size} bytes; an audit file is at most {MAX_FILE_BYTES} bytes"])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not a text file (byte {exc.start} is not UTF-8); give the audit's YAML file"]) from None
    return text, parse_yaml(path, text)


def parse_yaml(path: Path, text: str) -> Any:
    """An audit file's contents parsed; a ConfigError, naming ``path``, when they are not YAML."""
    try:
        raw = yaml.load(text, Loader=AuditLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else f"character {getattr(exc, 'position', '?')}"
        why = " ".join(str(getattr(exc, "problem", None) or getattr(exc, "reason", None) or exc).split())
        raise ConfigError([f"{path}: {where}: not valid YAML: {why}"]) from None
    except RecursionError:
        raise ConfigError([f"{path}: nested too deeply to be an audit file"]) from None
    if _expanded_size(raw, {}) > MAX_YAML_VALUES:
        raise ConfigError([f"{path}: its aliases expand to more than {MAX_YAML_VALUES} values; "
                           "an audit file needs far fewer"])
    return raw


AuditLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
