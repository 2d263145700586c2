"""Built-in defenses, one module per family, and the ``Defense`` contract every plugin follows."""
from leakaudit.plugins.defense import Defense, DeterministicDefense, SharedUpdate

__all__ = ["Defense", "DeterministicDefense", "SharedUpdate"]
