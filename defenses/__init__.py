"""Built-in defenses, one module per family, and the ``Defense`` contract every plugin follows."""
from defenses.base import DeterministicDefense, Defense, SharedUpdate

__all__ = ["Defense", "DeterministicDefense", "SharedUpdate"]
