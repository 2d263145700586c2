"""Every hook a leakaudit plugin may implement.

A plugin is any module or object with functions marked ``@leakaudit.hookimpl`` whose
names match the functions below. Built-in defenses, attacks, metrics, models and
datasets register through these very hooks. Each ``register_*`` hook returns an
iterable of components; a name registered twice is an error naming both plugins.
"""
from __future__ import annotations

from leakaudit.plugins import hookspec


@hookspec
def register_defenses():
    """Return defense classes (subclasses of ``leakaudit.Defense``).

    Each class carries ``name`` (the YAML name), ``params`` (a dict of
    ``leakaudit.Param``) and a docstring whose first line is shown by
    ``leakaudit plugins``. Its ``log_likelihood`` is what the Bayes-optimal
    attacker maximises, so it must match how ``share`` samples.
    """


@hookspec
def register_attacks():
    """Return attack classes (subclasses of ``leakaudit.Attack``).

    ``reconstruct(observed, threat, generator)`` gets the shared update, the
    attacker's knowledge (``leakaudit.ThreatModel``) and a seeded generator, and
    returns an ``leakaudit.Reconstruction`` in [0, 1] pixel space.
    """


@hookspec
def register_metrics():
    """Return ``leakaudit.Metric`` objects.

    Image metrics receive reconstructions already matched to their originals by
    best assignment and return one value per image; label metrics score the
    recovered label multiset against the true one.
    """


@hookspec
def register_models():
    """Return ``leakaudit.ModelSpec`` objects (name, builder, params).

    The builder is called as ``build(channels=, num_classes=, image_size=, **params)``
    and returns a fresh ``torch.nn.Module`` initialised from torch's global RNG,
    which the evaluator seeds.
    """


@hookspec
def register_datasets():
    """Return ``leakaudit.DatasetSpec`` objects (name, loader, params).

    The loader returns an ``leakaudit.ImageData`` with train and test
    splits in [0, 1] pixel space; it must not reach the network unless the audit
    says ``download: true``.
    """


@hookspec
def report_extras(summary, audit, out_dir):
    """Return a list of ``(title, html)`` sections appended to ``report.html``.

    ``summary`` is the run's typed ``Summary`` (``summary.to_json()`` is what ``summary.json`` holds),
    ``audit`` the validated
    ``leakaudit.Audit`` and ``out_dir`` the run's ``pathlib.Path``.
    """
