"""leakaudit for Lightning (install ``leakaudit[lightning]``): the public home of its callback.

    from leakaudit import LeakMonitor
    from leakaudit.lightning import LeakAuditCallback

    monitor = LeakMonitor(every=100, out="runs/lightning")
    trainer = Trainer(callbacks=[LeakAuditCallback(monitor)])
"""
from leakaudit.evaluator.live.lightning import LeakAuditCallback

__all__ = ["LeakAuditCallback"]
