"""The `diagnose`, `timeline` and `compare` subcommands (docs/analysis.md).

phaselab/cli.py adds them with `add_analysis_parsers(sub)` and dispatches with `run_analysis(ns)`;
`python -m phaselab.analysis.cli COMMAND ...` runs the same without the rest of the CLI. Building
the parsers imports nothing heavy (no torch, no matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

COMMANDS = ("diagnose", "timeline", "compare")


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
                   help="machine ceilings JSON from benchmarks/roofline.py (default: benchmarks/results/roofline.json "
                        "when present, else documented assumed values)")
    d.add_argument("--out", default=None, help="write the diagnosis files here instead of RUN_DIR")
    d.add_argument("--no-write", action="store_true", help="print only; write no file")
    d.add_argument("--json", action="store_true", help="print diagnosis.json instead of the text")

    t = subparsers.add_parser(
        "timeline", help="PNG and interactive HTML timeline of one or more runs (shared time axis)",
        description="Draw one lane per worker (iterations coloured by prefill/decode token mix) and one lane per "
                    "request (queue, prefill chunks, KV transfer, decode tokens, stalls marked). Several runs are "
                    "drawn on one shared time axis.")
    t.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories (two or more: drawn together)")
    t.add_argument("--png", default=None, help="PNG path (default: RUN_DIR/timeline.png of the first run)")
    t.add_argument("--html", default=None, help="HTML path (default: RUN_DIR/timeline.html of the first run)")
    t.add_argument("--title", action="append", default=None, help="title of each run (repeat, in order)")

    c = subparsers.add_parser(
        "compare", help="prefill-first vs chunked vs disaggregated on the bundled model (or simulated), explained",
        description="Run the interference workload and an input-length sweep on the bundled model under "
                    "prefill-first, chunked prefill (two budgets) and disaggregated 1P1D serving; print the tables "
                    "side by side with the top diagnosis of each, and write report.html with the timelines. With "
                    "--simulate, the same comparison is simulated at cluster scale (docs/simulator.md): "
                    "`phaselab compare --simulate --hardware h100 --model llama-3-70b --gpus 8`.")
    c.add_argument("--quick", action="store_true", help="smaller workloads (under 2 minutes on 2 cores)")
    c.add_argument("--out", default=None, help="output directory (default: runs/compare-YYYYmmdd-HHMMSS)")
    c.add_argument("--no-disagg", action="store_true", help="leave out the disaggregated configuration (no Ray)")
    c.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    c.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                   help="run nothing: re-diagnose the runs of an earlier compare in DIR and rewrite its report")
    s = c.add_argument_group(
        "simulation (--simulate)",
        "Simulate the deployments on GPUs instead of running the bundled model: prefill-first and chunked colocated "
        "engines on all the GPUs, and disaggregated prefill:decode pools on the same GPUs, under one workload "
        "(plus the interference workload and a length sweep).")
    s.add_argument("--simulate", action="store_true", help="simulate instead of running the bundled model")
    s.add_argument("--model", default=None,
                   help="catalog model (phaselab simulate catalog) or a Hugging Face config.json / model directory "
                        "(default with --simulate: llama-3-70b)")
    s.add_argument("--hardware", default=None, help="a100, h100, h200 or cpu (default with --simulate: h100)")
    s.add_argument("--gpus", type=int, default=None, help="GPUs of every deployment (default with --simulate: 8)")
    s.add_argument("--tp", type=int, default=None,
                   help="tensor parallelism per engine (default: the smallest power of two at which the weights take "
                        "at most half of each GPU's memory)")
    s.add_argument("--prefill-decode", default=None, metavar="P:D",
                   help="disaggregated engines per pool, or a ratio scaled to --gpus / --tp engines "
                        "(default: half and half)")
    s.add_argument("--link", default=None,
                   help="disaggregated KV transfer link: nvlink3, nvlink4, pcie4, pcie5, ib-hdr, ib-ndr, 25gbe, "
                        "100gbe (default: the hardware's NVLink)")
    s.add_argument("--budgets", default=None,
                   help="chunked token budgets, comma-separated (default with --simulate: 2048,512; the first is "
                        "also the disaggregated prefill engines')")
    s.add_argument("--request-rate", type=float, default=None,
                   help="load workload: requests per second, open loop (default with --simulate: 4; inf: all at once)")
    s.add_argument("--num-prompts", type=int, default=None,
                   help="load workload: requests (default with --simulate: 500; 100 with --quick)")
    s.add_argument("--input-len", default=None,
                   help="load workload: input tokens, N or uniform:LO:HI etc. (default: uniform:256:2048)")
    s.add_argument("--output-len", default=None,
                   help="load workload: output tokens (default: uniform:64:512)")
    s.add_argument("--burstiness", type=float, default=None, help="gamma shape of the gaps; 1 = Poisson (default)")
    s.add_argument("--seed", type=int, default=None, help="load workload seed, as phaselab bench's (default: 0)")
    s.add_argument("--params", default=None, help="cost parameters JSON (phaselab simulate calibrate)")
    s.add_argument("--dtype", default=None, help="bfloat16 (default), float16, fp8 or float32")
    s.add_argument("--first-token-from", default=None, choices=["prefill", "decode"],
                   help="disaggregated: who streams the first token (default: prefill, as phaselab's router)")
    s.add_argument("--transfer-mode", default=None, choices=["after-prefill", "layer-by-layer"],
                   help="disaggregated KV transfer (default: after-prefill)")


def run_analysis(ns: argparse.Namespace) -> int:
    if ns.command == "diagnose":
        return _diagnose(ns)
    if ns.command == "timeline":
        return _timeline(ns)
    if ns.command == "compare":
        return _compare(ns)
    raise AssertionError(ns.command)


def _diagnose(ns: argparse.Namespace) -> int:
    import json

    from phaselab.analysis.diagnose import diagnose, diagnosis_text, write_diagnosis

    diag = diagnose(ns.run_dir, roofline=ns.roofline)
    if ns.json:
        print(json.dumps(diag.to_json(), indent=2, default=str))
    else:
        sys.stdout.write(diagnosis_text(diag))
    if not ns.no_write:
        files = write_diagnosis(diag, ns.out or ns.run_dir)
        print(f"wrote {files['md']}, {files['html'].name}, {files['json'].name}", file=sys.stderr)
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


SIM_OPTIONS = ("model", "hardware", "gpus", "tp", "prefill_decode", "link", "budgets", "request_rate", "num_prompts",
               "input_len", "output_len", "burstiness", "seed", "params", "dtype", "first_token_from", "transfer_mode")


def _sim_spec(ns: argparse.Namespace) -> Any:
    from phaselab.analysis.compare import sim_spec

    given = {k: getattr(ns, k) for k in SIM_OPTIONS if getattr(ns, k) is not None and k not in ("budgets",)}
    given["num_gpus"] = given.pop("gpus", 8)
    given["split"] = given.pop("prefill_decode", None)
    given.setdefault("model", "llama-3-70b")
    given.setdefault("hardware", "h100")
    given.setdefault("num_prompts", 100 if ns.quick else 500)
    return sim_spec(**given)


def _compare(ns: argparse.Namespace) -> int:
    from phaselab.analysis.compare import run_compare
    from phaselab.analysis.doc import render_text
    from phaselab.analysis.report import compare_doc
    from phaselab.errors import ConfigError

    if not ns.simulate:
        extra = [f"--{k.replace('_', '-')}" for k in SIM_OPTIONS if getattr(ns, k, None) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} only apply to a simulated compare: add --simulate "
                              "(the real compare runs the bundled model on this machine)")
    if ns.simulate and not ns.from_dir:
        from phaselab.analysis.compare import run_sim_compare

        try:
            budgets = [int(b) for b in (ns.budgets or "2048,512").split(",") if b.strip()]
        except ValueError:
            raise ConfigError(f"--budgets {ns.budgets!r}: write token budgets separated by commas, e.g. 2048,512") \
                from None
        spec = _sim_spec(ns)
        out = ns.out or f"runs/compare-sim-{time.strftime('%Y%m%d-%H%M%S')}"
        result = run_sim_compare(out, spec, budgets, disagg=not ns.no_disagg, show_progress=not ns.no_progress)
    elif ns.from_dir:
        from phaselab.analysis.compare import load_compare
        from phaselab.analysis.report import write_compare_outputs

        result = load_compare(ns.from_dir)
        result.files = write_compare_outputs(result)
    else:
        out = ns.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}"
        result = run_compare(out, quick=ns.quick, disagg=not ns.no_disagg, show_progress=not ns.no_progress)
    sys.stdout.write(render_text(compare_doc(result)))
    print(f"\nreport: {result.files['report']}  (timelines: {result.files.get('timeline_png')}, "
          f"{result.files.get('timeline_html')})", file=sys.stderr)
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
