"""leakaudit's plugin layer, the bottom of the package: the contracts a plugin implements
(``defense``, ``attack``, ``protocol``, ``components``), hook markers, parameter specs, discovery
and the name registry. Nothing here imports the defense or attack families or the engine.

Plugin authors import from the top-level package::

    from leakaudit import Defense, Param, hookimpl
"""
import pluggy

from leakaudit.plugins.spec import Param, PluginError

PROJECT = "leakaudit"
hookimpl = pluggy.HookimplMarker(PROJECT)
hookspec = pluggy.HookspecMarker(PROJECT)

__all__ = ["PROJECT", "hookimpl", "hookspec", "Param", "PluginError"]
