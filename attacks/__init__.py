"""Built-in attacks, priors and label recovery, and the ``Attack`` contract every plugin follows."""
from leakaudit.plugins.attack import Attack, Reconstruction, ThreatModel

__all__ = ["Attack", "Reconstruction", "ThreatModel"]
