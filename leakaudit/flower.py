"""leakaudit for Flower (install ``leakaudit[flower]``): the public home of its client mod, its NumPyClient
wrapper and its server strategy.

    from leakaudit.flower import LeakAuditMod, LeakAuditStrategy

    app = ClientApp(mods=[LeakAuditMod(Net, out="runs/flower")])     # each client's rounds, attacked
    strategy = LeakAuditStrategy(FedAvg(), Net(), client_loader)      # what the server sees, attacked
"""
from leakaudit.evaluator.live.flower import LeakAuditClient, LeakAuditMod
from leakaudit.evaluator.live.strategy import LeakAuditStrategy

__all__ = ["LeakAuditClient", "LeakAuditMod", "LeakAuditStrategy"]
