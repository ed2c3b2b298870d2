"""`kmesh run STAGE | pipeline [SNAKEMAKE ARGS] | doctor | render | diagnose [NAME ...] | service ...`
(also `python -m kmesh ...`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kmesh.errors import KMeshError


def cmd_run(args: argparse.Namespace) -> int:
    from kmesh.config import load_config, parse_overrides
    from kmesh.stages import result_path, stage_runner

    cfg = load_config(profile=args.profile, config_path=args.config, overrides=parse_overrides(args.set),
                      overlays=args.overlay)
    run = stage_runner(args.stage)
    result = run(cfg)
    out = Path(args.out or result_path(cfg, args.stage))
    result.write(out)
    s = result.summary()
    print(f"[kmesh] {args.stage} ({cfg.profile}): {s['passed']} passed, {s['failed']} failed, "
          f"{s['skipped']} skipped ({len(s['skips_unallowed'])} not allowed) -> {out}")
    use = result.provenance["resources"]
    print(f"[kmesh] {args.stage}: {use['cpu_s']:.0f} CPU-s ({use['own_cpu_s']:.0f} its own, "
          f"{use['children_cpu_s']:.0f} its reaped children's), peak RSS {use['max_rss_mib']:.0f} MiB")
    allowed = {a["case"]: a for a in s["skips_allowed"]}
    for c in result.cases:
        if c.passed is False:
            first = (c.error or "").splitlines()[0] if c.error else \
                ", ".join(k for k, v in c.checks.items() if v["ok"] is False)
            print(f"[kmesh]   FAILED {c.id}: {first}", file=sys.stderr)
        elif c.passed is None and c.id in allowed:
            print(f"[kmesh]   skipped (allowed: {allowed[c.id]['reason']}) {c.id}: {c.skipped}", file=sys.stderr)
        elif c.passed is None:
            # A skip no allowance of this profile covers proves nothing: it fails the stage like a failed case.
            print(f"[kmesh]   FAILED {c.id}: skip not allowed for {args.stage} on profile {cfg.profile} "
                  f"(no {args.stage}.allow_skips entry matches): {c.skipped}", file=sys.stderr)
    if s["passed"] == 0:
        print(f"[kmesh]   FAILED {args.stage}: no case passed", file=sys.stderr)
    return 0 if result.ok else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from kmesh.doctor import print_report, probe

    caps = probe(Path(args.results_dir))
    if args.json:
        print(json.dumps(caps, indent=1))
    else:
        print_report(caps)
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from kmesh.config import load_config
    from kmesh.report.render import render_all

    cfg = load_config(profile=args.profile, config_path=args.config)
    written = render_all(cfg)
    for p in written:
        print(p)
    return 0


def cmd_times(args: argparse.Namespace) -> int:
    import platform

    from kmesh.stage_times import from_committed, markdown, recorded, variant, write_committed
    from kmesh.stages import STAGES

    key = variant(args.profile, args.overlay)
    if args.committed:
        times = from_committed(key)
        if not times:
            print(f"[kmesh] the committed table holds no {key}", file=sys.stderr)
            return 1
        print(markdown(times, STAGES))
        return 0
    times = recorded(Path(args.results_dir), args.profile, key)
    if not times:
        print(f"[kmesh] no stage results of {key} under {args.results_dir}/{args.profile}", file=sys.stderr)
        return 1
    print(markdown(times, STAGES))
    print(f"\n{key}, revision(s) {', '.join(sorted({t.rev for t in times.values()}))}")
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}"
        write_committed(times, key, machine, args.note)
        print(f"[kmesh] wrote {key} into the committed table")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from kmesh import diagnostics

    if args.name is None:
        print("diagnostics (python -m kmesh diagnose NAME [--help | ARGS]):")
        print(diagnostics.listing())
        return 0
    try:
        return diagnostics.run(args.name, args.args)
    except diagnostics.UnknownDiagnosticError:
        print(f"diagnostics:\n{diagnostics.listing()}", file=sys.stderr)
        raise


def cmd_host_speed(args: argparse.Namespace) -> int:
    from kmesh import hostspeed

    return hostspeed.main(args.json, args.out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kmesh", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run one pipeline stage and write its result file")
    r.add_argument("stage")
    r.add_argument("--profile", choices=["cpu", "cuda"], default=None)
    r.add_argument("--config", default=None, help="config file (default: config/config.yaml)")
    r.add_argument("--out", default=None, help="result file (default: results/<profile>/<stage>/result.json)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    r.add_argument("--overlay", action="append", default=[], metavar="FILE",
                   help="a reduced-size overlay over the profile (e.g. config/overlays/test.yaml; no skips)")
    r.set_defaults(func=cmd_run)

    # Listed for --help only: main() hands everything after `pipeline` to kmesh.console before argparse sees it.
    pl = sub.add_parser("pipeline", help="run Snakemake with every argument that follows (`kmesh pipeline -h`: "
                                         "Snakemake's), printing one line per stage as it starts and ends; "
                                         "the full log goes to <results_dir>/<profile>/logs/snakemake.log")
    pl.add_argument("snakemake_args", nargs=argparse.REMAINDER, metavar="SNAKEMAKE_ARGS")

    d = sub.add_parser("doctor", help="print what this machine supports")
    d.add_argument("--results-dir", default="results", help="where O_DIRECT is probed")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_doctor)

    n = sub.add_parser("render", help="render tables and plots from existing result files")
    n.add_argument("--profile", choices=["cpu", "cuda"], default=None)
    n.add_argument("--config", default=None)
    n.set_defaults(func=cmd_render)

    t = sub.add_parser("times", help="each stage's wall and CPU seconds from a results folder's records (Markdown)")
    t.add_argument("--results-dir", default="results")
    t.add_argument("--profile", choices=["cpu", "cuda"], default="cpu")
    t.add_argument("--overlay", action="append", default=[], metavar="NAME",
                   help="the overlay the run used (test, long): only its records are read")
    t.add_argument("--write", action="store_true", help="also put them into docs/measurements/stage-times.json")
    t.add_argument("--committed", action="store_true",
                   help="print the committed table's records of this profile and overlay instead (docs/testing.md)")
    t.add_argument("--note", default="", help="with --write: how the run was made (command, machine state)")
    t.set_defaults(func=cmd_times)

    h = sub.add_parser("host-speed", help="this machine's CPU and the seconds one core takes for two fixed "
                                          "workloads (kmesh.hostspeed: tells apart runs on different hosts)")
    h.add_argument("--json", action="store_true", help="print the facts as JSON instead of a line")
    h.add_argument("--out", default=None, metavar="FILE", help="also write them to FILE (JSON)")
    h.set_defaults(func=cmd_host_speed)

    g = sub.add_parser("diagnose", help="run one measurement diagnostic (kmesh.diagnostics); none named: list them")
    g.add_argument("name", nargs="?", help="which diagnostic (leave out to list them)")
    g.add_argument("args", nargs=argparse.REMAINDER, help="the diagnostic's own arguments (NAME --help lists them)")
    g.set_defaults(func=cmd_diagnose)

    try:
        from kmesh.service.cli import add_service_parser
    except ImportError:
        pass
    else:
        add_service_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["pipeline"]:
            # Every argument after `pipeline` is Snakemake's; argparse would read -n, --config ... as kmesh's.
            from kmesh.console import run_pipeline

            return run_pipeline(argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except KMeshError as e:
        print(f"kmesh: error: {e}", file=sys.stderr)
        return 2
