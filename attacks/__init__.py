"""Built-in attacks, priors and label recovery, and the ``Attack`` contract every plugin follows."""
from attacks.base import Attack, Reconstruction, ThreatModel

__all__ = ["Attack", "Reconstruction", "ThreatModel"]
