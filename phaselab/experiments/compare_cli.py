"""The `compare` subcommand (docs/analysis.md): phaselab/cli.py adds it with
`add_compare_parser(sub)` and dispatches with `run_compare_cli(ns)`. Building the parser imports
nothing heavy (no torch, no matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from phaselab.core.config import BUDGETS_TRIED

# compare's chunked budgets, largest first: the first also serves the disaggregated prefill engines
COMPARE_BUDGETS = tuple(sorted(BUDGETS_TRIED, reverse=True))
COMPARE_BUDGETS_TEXT = ",".join(map(str, COMPARE_BUDGETS))


def add_compare_parser(subparsers: Any) -> None:
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
    c.add_argument("--slo-tbt-ms", default=None, metavar="T[,T...]",
                   help="TBT targets (ms) of the adaptive-budget columns, comma-separated; 'none' leaves them out "
                        "(default: 200 on this machine's bundled model, 50 with --simulate)")
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
                   help=f"chunked token budgets, comma-separated (default with --simulate: {COMPARE_BUDGETS_TEXT}; the first is "
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


SIM_OPTIONS = ("model", "hardware", "gpus", "tp", "prefill_decode", "link", "budgets", "request_rate", "num_prompts",
               "input_len", "output_len", "burstiness", "seed", "params", "dtype", "first_token_from", "transfer_mode")


def _sim_spec(ns: argparse.Namespace) -> Any:
    from phaselab.experiments.compare_sim import sim_spec

    given = {k: getattr(ns, k) for k in SIM_OPTIONS if getattr(ns, k) is not None and k not in ("budgets",)}
    given["num_gpus"] = given.pop("gpus", 8)
    given["split"] = given.pop("prefill_decode", None)
    given.setdefault("model", "llama-3-70b")
    given.setdefault("hardware", "h100")
    given.setdefault("num_prompts", 100 if ns.quick else 500)
    return sim_spec(**given)


def _targets(text: str | None) -> tuple[float, ...] | None:
    """--slo-tbt-ms: None (the default), 'none' (no adaptive column) or targets in ms."""
    from phaselab.errors import ConfigError

    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        targets = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--slo-tbt-ms {text!r}: write targets in ms separated by commas, e.g. 100,200, "
                          "or 'none'") from None
    if any(t <= 0 for t in targets):
        raise ConfigError(f"--slo-tbt-ms {text!r}: every target must be > 0 ms")
    return targets


def run_compare_cli(ns: argparse.Namespace) -> int:
    from phaselab.experiments.compare import run_compare
    from phaselab.analysis.doc import render_text
    from phaselab.experiments.compare_report import compare_doc
    from phaselab.errors import ConfigError

    if not ns.simulate:
        extra = [f"--{k.replace('_', '-')}" for k in SIM_OPTIONS if getattr(ns, k, None) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} only apply to a simulated compare: add --simulate "
                              "(the real compare runs the bundled model on this machine)")
    targets = _targets(ns.slo_tbt_ms)
    if ns.simulate and not ns.from_dir:
        from phaselab.experiments.compare import DEFAULT_SIM_SLO_TBT_MS
        from phaselab.experiments.compare_sim import run_sim_compare

        try:
            budgets = [int(b) for b in (ns.budgets or COMPARE_BUDGETS_TEXT).split(",") if b.strip()]
        except ValueError:
            raise ConfigError(f"--budgets {ns.budgets!r}: write token budgets separated by commas, e.g. 2048,512") \
                from None
        spec = _sim_spec(ns)
        out = ns.out or f"runs/compare-sim-{time.strftime('%Y%m%d-%H%M%S')}"
        result = run_sim_compare(out, spec, budgets, disagg=not ns.no_disagg, show_progress=not ns.no_progress,
                                 slo_tbt_ms=(DEFAULT_SIM_SLO_TBT_MS,) if targets is None else targets)
    elif ns.from_dir:
        from phaselab.experiments.compare import load_compare
        from phaselab.experiments.compare_report import write_compare_outputs

        from phaselab.experiments.compare import warnings_once

        with warnings_once():  # the same warning from every run's predictions: once
            result = load_compare(ns.from_dir)
            result.files = write_compare_outputs(result)
    else:
        out = ns.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}"
        from phaselab.experiments.compare import DEFAULT_SLO_TBT_MS

        result = run_compare(out, quick=ns.quick, disagg=not ns.no_disagg, show_progress=not ns.no_progress,
                             slo_tbt_ms=(DEFAULT_SLO_TBT_MS,) if targets is None else targets)
    sys.stdout.write(render_text(compare_doc(result)))
    print(f"\nreport: {result.files['report']}  (timelines: {result.files.get('timeline_png')}, "
          f"{result.files.get('timeline_html')})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phaselab", description="phaselab compare")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_compare_parser(sub)
    ns = parser.parse_args(argv)
    from phaselab.errors import PhaselabError

    try:
        return run_compare_cli(ns)
    except PhaselabError as e:
        print(f"phaselab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
