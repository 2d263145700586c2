"""Built-in defenses, one module per family, and the ``Defense`` contract every plugin follows."""
from leakaudit.plugins.defense import DeterministicDefense, Defense, SharedUpdate

__all__ = ["Defense", "DeterministicDefense", "SharedUpdate"]
