"""Users' own code named in an audit file: ``"package.module:attribute"`` resolved and called."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
from typing import Any, Callable

from leakaudit.plugins.spec import import_failure


def import_factory(path: str) -> Callable[..., Any]:
    """Resolve ``"package.module:attribute"`` to a callable without calling it; ValueError with a one-line reason."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise ValueError(f"cannot import module {module_name!r}: {import_failure(exc)}") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(found):
        raise ValueError(f"{path!r} is a {type(found).__name__}, not a function or class to call")
    return found


def locate_factory(path: str) -> str:
    """Where the module of ``"package.module:attribute"`` is, found without importing it or its packages (no
    user code runs: what ``leakaudit validate`` checks); ValueError with a one-line reason when it is not found."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form 'package.module:factory'")
    origin, search, parts = None, None, module_name.split(".")
    for i, part in enumerate(parts):
        try:
            spec = (importlib.util.find_spec(part) if i == 0 else
                    importlib.machinery.PathFinder.find_spec(part, search))
        except (ImportError, ValueError):
            spec = None
        if spec is None or (i < len(parts) - 1 and not spec.submodule_search_locations):
            raise ValueError(f"cannot import module {module_name!r}: {'.'.join(parts[:i + 1])!r} is not found on "
                             "the import path (the audit file's folder is on it)")
        origin, search = spec.origin, spec.submodule_search_locations
    return origin or module_name


def call_with_accepted(factory: Callable[..., Any], offered: dict[str, Any], params: dict[str, Any]) -> Any:
    """Call a user's factory with ``params`` plus whichever of ``offered`` its signature accepts."""
    try:
        sig = inspect.signature(factory)
        takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        kwargs = {k: v for k, v in offered.items() if takes_all or k in sig.parameters}
    except (TypeError, ValueError):
        kwargs = {}
    return factory(**kwargs, **params)
