"""The `diagnose` and `timeline` subcommands (docs/analysis.md); `compare` is phaselab/experiments/compare_cli.py.

phaselab/cli.py adds them with `add_analysis_parsers(sub)` and dispatches with `run_analysis(ns)`;
`python -m phaselab.analysis.diagnose_cli COMMAND ...` runs the same without the rest of the CLI. Building
the parsers imports nothing heavy (no torch, no matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

COMMANDS = ("diagnose", "timeline")


def add_analysis_parsers(subparsers: Any) -> None:
    d = subparsers.add_parser(
        "diagnose", help="which phase is slow, why, and what would fix it (a run directory)",
        description="Work through the symptom table on a run directory (phaselab generate/serve/compare --record, "
                    "the simulator, or a `phaselab bench --record` client run against any server with its /metrics "
                    "scrapes) and rank the causes with their evidence, the change each suggests and the number that "
                    "would show it worked. Prints the diagnosis and writes diagnosis.md, diagnosis.html and "
                    "diagnosis.json into the run directory.")
    d.add_argument("run_dir", metavar="RUN_DIR", help="a phaselab run directory (or a bench client run directory)")
    d.add_argument("--roofline", default=None,
                   help="machine ceilings JSON from benchmarks/roofline.py (default: the run's own host's ceilings, "
                        "recorded in the run or cached for its CPU, measured now when the run was made on this CPU; "
                        "else benchmarks/results/roofline.json when present, else documented assumed values)")
    d.add_argument("--out", default=None, help="write the diagnosis files here instead of RUN_DIR")
    d.add_argument("--no-write", action="store_true", help="print only; write no file")
    d.add_argument("--json", action="store_true", help="print diagnosis.json instead of the text")
    d.add_argument("--verify", action="store_true",
                   help="rerun the recorded workload as recorded and with the top suggested change (runs phaselab "
                        "made) and print the predicted vs measured change of each figure; one-engine runs rerun in "
                        "this process, or against servers given with --before-url/--after-url")
    d.add_argument("--before-url", default=None, metavar="URL",
                   help="--verify against servers: the deployment as recorded (a disaggregated run needs this: its "
                        "workers and link cannot be rebuilt in this process)")
    d.add_argument("--after-url", default=None, metavar="URL",
                   help="--verify against servers: the deployment with the suggested change")

    t = subparsers.add_parser(
        "timeline", help="PNG and interactive HTML timeline of one or more runs (shared time axis)",
        description="Draw one lane per worker (iterations coloured by prefill/decode token mix) and one lane per "
                    "request (queue, prefill chunks, KV transfer, decode tokens, stalls marked). Several runs are "
                    "drawn on one shared time axis.")
    t.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories (two or more: drawn together)")
    t.add_argument("--png", default=None, help="PNG path (default: RUN_DIR/timeline.png of the first run)")
    t.add_argument("--html", default=None, help="HTML path (default: RUN_DIR/timeline.html of the first run)")
    t.add_argument("--title", action="append", default=None, help="title of each run (repeat, in order)")


def run_analysis(ns: argparse.Namespace, verify: Callable[[Any, argparse.Namespace], int] | None = None) -> int:
    """`verify`: what `diagnose --verify` runs on the diagnosis (phaselab/experiments/diagnose_verify.py's
    verify_top, passed in by phaselab/cli.py: rerunning engines is the layer above this package)."""
    if ns.command == "diagnose":
        return _diagnose(ns, verify)
    if ns.command == "timeline":
        return _timeline(ns)
    raise AssertionError(ns.command)


def _diagnose(ns: argparse.Namespace, verify: Callable[[Any, argparse.Namespace], int] | None) -> int:
    import json

    from phaselab.analysis.diagnose import diagnose, diagnosis_text, write_diagnosis

    if not ns.roofline:  # a run of this CPU is judged against this host's ceilings: measured once, cached
        from phaselab import envs
        from phaselab.sim.measure_host import cache_run_host, read_config

        if not envs.ROOFLINE.get():
            cache_run_host(ns.run_dir, read_config(ns.run_dir),
                           log=lambda m: print(f"phaselab diagnose: {m}", file=sys.stderr))
    diag = diagnose(ns.run_dir, roofline=ns.roofline)
    if ns.json:
        print(json.dumps(diag.to_json(), indent=2, default=str))
    else:
        sys.stdout.write(diagnosis_text(diag))
    if not ns.no_write:
        files = write_diagnosis(diag, ns.out or ns.run_dir)
        print(f"wrote {files['md']}, {files['html'].name}, {files['json'].name}", file=sys.stderr)
    if ns.verify:
        if verify is None:
            print("phaselab diagnose --verify: run it as `phaselab diagnose RUN --verify` (the reruns are "
                  "phaselab/experiments' work, which this entry point does not load)", file=sys.stderr)
            return 2
        return verify(diag, ns)
    return 0


def _timeline(ns: argparse.Namespace) -> int:
    from phaselab.analysis.timeline import write_timeline

    first = Path(ns.run_dirs[0])
    png = ns.png or str(first / "timeline.png")
    page = ns.html or str(first / "timeline.html")
    titles = ns.title
    if titles is not None and len(titles) != len(ns.run_dirs):
        print(f"phaselab timeline: error: {len(titles)} --title for {len(ns.run_dirs)} runs", file=sys.stderr)
        return 2
    out_png, out_html = write_timeline(ns.run_dirs, png, page, titles)
    print(f"wrote {out_png} and {out_html}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phaselab", description="phaselab analysis commands")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_analysis_parsers(sub)
    ns = parser.parse_args(argv)
    from phaselab.errors import PhaselabError

    try:
        return run_analysis(ns)
    except PhaselabError as e:
        print(f"phaselab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
