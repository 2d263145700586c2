"""leakaudit's plugin system: hook markers, parameter specs, discovery and the name registry.

Plugin authors need two names from here::

    from plugins import hookimpl, Param

and the base classes from their rooms (``defenses.Defense``, ``attacks.Attack``).
"""
import pluggy

from plugins.spec import Param, PluginError

PROJECT = "leakaudit"
hookimpl = pluggy.HookimplMarker(PROJECT)
hookspec = pluggy.HookspecMarker(PROJECT)

__all__ = ["PROJECT", "hookimpl", "hookspec", "Param", "PluginError"]
