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

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
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


LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")  # what YAML counts as the end of a line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _spaces(n: int) -> str:
    return f"{n} space{'' if n == 1 else 's'}"


def _columns(line: str) -> str:
    """Where a line's key sits, and its dash when it starts a list item: 'its dash at 2, its keys at 4'."""
    rest = line.lstrip(" ")
    if not rest.startswith("- "):
        return f"its key at {_indent(line)}"
    return f"its dash at {_indent(line)}, its keys at {_indent(line) + 2 + _indent(rest[2:])}"


def _in_plain_words(exc: yaml.YAMLError, lines: list[str]) -> str | None:
    """``line N: ...`` for the layout mistakes people make (indentation, a missing ':', an unclosed bracket or
    quote, a tab), naming the line where the mistake is rather than where the parser noticed it; None for
    the rest, which keep the parser's own words."""
    problem, context = getattr(exc, "problem", None) or "", getattr(exc, "context", None) or ""
    mark, opened = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    if mark is None:
        return None

    def raw(n: int) -> str:  # line n (0-based) as written
        return lines[n] if 0 <= n < len(lines) else ""

    def text(n: int) -> str:  # stripped, at most 60 characters
        return raw(n).strip()[:60]

    above = next((n for n in range(mark.line - 1, -1, -1) if text(n) and not text(n).startswith("#")), None)
    if "cannot start any token" in problem and "\\t" in problem:
        return f"line {mark.line + 1}: a tab in the indentation; YAML indents with spaces only"
    if "could not find expected ':'" in problem and opened is not None:
        return (f"line {opened.line + 1}: {text(opened.line)!r} is a key without a ':' after it; write "
                f"'{text(opened.line).split()[0] if text(opened.line) else 'key'}:' and its value")
    if context.startswith("while parsing a flow") and opened is not None:
        bracket = "{" if raw(opened.line)[opened.column:].startswith("{") else "["
        close = {"[": "]", "{": "}"}[bracket]
        return (f"line {opened.line + 1}: the {bracket!r} opened here is not closed; end it with {close!r} on the "
                "same line, or write one item per line")
    if context.startswith("while scanning a quoted scalar") and opened is not None:
        return f"line {opened.line + 1}: the quote opened here is not closed; end the value with the same quote"
    if problem == "mapping values are not allowed here":
        if above is not None and _indent(raw(mark.line)) > _indent(raw(above)) and ": " in text(above):
            return (f"line {mark.line + 1}: {text(mark.line)!r} is indented deeper than {text(above)!r} on line "
                    f"{above + 1}, which already has a value; indent it as that key (or, to nest it, leave that "
                    "key's value empty)")
        return f"line {mark.line + 1}: {text(mark.line)!r} holds a second ': ' in one value; put the value in quotes"
    if problem.startswith("expected <block end>") and above is not None:
        return (f"line {mark.line + 1}: {text(mark.line)!r} is indented {_spaces(_indent(raw(mark.line)))}, which "
                f"lines up with no key or list above it ({text(above)!r} on line {above + 1} has "
                f"{_columns(raw(above))}); indent it as the keys or dashes it belongs with")
    return None


def parse_yaml(path: Path, text: str) -> Any:
    """An audit file's contents parsed; a ConfigError, naming ``path``, when they are not YAML."""
    try:
        raw = yaml.load(text, Loader=AuditLoader)
    except yaml.YAMLError as exc:
        plain = _in_plain_words(exc, LINE_BREAK.split(text))
        if plain is not None:
            raise ConfigError([f"{path}: {plain}"]) from None
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
