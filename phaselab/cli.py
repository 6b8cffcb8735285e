"""`phaselab` command line. Every engine option is generated from EngineArgs' help text.

Torch is imported only after the thread settings are fixed: OpenMP reads OMP_WAIT_POLICY and
GOMP_SPINCOUNT when it starts. On a 2-core machine its default spin-waiting collapses as soon as a
second busy process shares the cores (one decode step: 2.4 s spinning vs 0.14 s PASSIVE, measured
here), while pure PASSIVE puts the threads to sleep between the ~120 kernel calls of one decode
step, and waking an idle (virtual) core costs more than the call: a batch-1 decode step of the
bundled model measured 24-32 ms PASSIVE and 10.5-11 ms with a bounded spin (GOMP_SPINCOUNT=20000:
threads spin that many pause loops after a parallel region, then sleep). But a spinning thread
holds a core that another busy thread needs: two bounded-spinning processes on 2 cores took 210 ms
a step, and `serve` (an HTTP event loop beside the engine, a client streaming from it) served
fewer tokens/s spinning than PASSIVE at concurrency 1 and 8 (benchmarks/wait_policy.py). Hence
`auto`: `generate` in colocated mode, an engine alone on the cores, spins briefly; `serve` and
disaggregated workers stay PASSIVE without spin. The native decode kernels no longer depend on
this: they run on phaselab's own pool (model/kernels/pool.c), whose workers spin briefly after a
call, yielding to other runnable threads, then sleep, and never make a call wait for a
descheduled worker; with it, an OpenMP spin brought `serve` nothing (one run each: c1 40 vs 51
tok/s, c8 93 vs 100) and still made two spinning processes 2.5x slower at batch 16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from phaselab import envs
from phaselab.cliargs import add_fields, field_values
from phaselab.engine_args import SPIN_COUNT, EngineArgs

SAMPLE_PROMPT = "Explain in two sentences why the first token of an LLM answer takes longer than the next ones."


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    add_fields(g, EngineArgs)  # types, defaults, choices and help from EngineArgs' fields
    g.add_argument("--omp-wait-policy", default="auto", choices=["auto", "PASSIVE", "ACTIVE", "default"],
                   help="OpenMP wait policy of this process. auto (default): PASSIVE, and for `generate` with a "
                        f"colocated engine, alone on the cores, a bounded spin (GOMP_SPINCOUNT={SPIN_COUNT} unless "
                        "set); `serve` (HTTP event loop and clients beside the engine) and disaggregated workers "
                        "do not spin. 'default' leaves OpenMP's own (unbounded spin: collapses when another busy "
                        "process shares the cores)")


def _add_disagg_args(p: argparse.ArgumentParser) -> None:
    """Every DisaggConfig field as a flag (its name without the `_s` unit suffix); used only with
    --mode disagg. Generated, like the engine flags, so a new field is a new flag with its help."""
    from phaselab.disagg.disagg_config import DisaggConfig

    g = p.add_argument_group("disaggregation (--mode disagg; docs/disaggregation.md)")
    add_fields(g, DisaggConfig, dest_prefix="disagg_", rename=lambda name: name.removesuffix("_s"))


def _disagg_config(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from phaselab.disagg.disagg_config import DisaggConfig

    return DisaggConfig(**field_values(ns, DisaggConfig, dest_prefix="disagg_"))


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**field_values(ns, EngineArgs))


def _set_threads(ns: argparse.Namespace, alone: bool = False) -> None:
    """OpenMP's settings before torch loads (module docstring). `alone`: this process's engine is
    the only busy thread on the machine (generate), so `auto` lets its threads spin briefly."""
    if ns.omp_wait_policy == "auto":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        if alone and getattr(ns, "mode", "colocated") != "disagg":  # disagg: this process only routes
            os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    elif ns.omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = ns.omp_wait_policy
    if ns.num_threads:
        os.environ["OMP_NUM_THREADS"] = str(ns.num_threads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phaselab",
        description="An LLM serving engine that schedules, records and explains prefill and decode.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate from one prompt, streaming tokens to the terminal",
                         description="Generate from one prompt on the engine, streaming text as it is sampled.")
    gen.add_argument("prompt", nargs="?", default=SAMPLE_PROMPT, help="the prompt (default: a sample question)")
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    s.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS may stop (default: 0)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top prob (default: 0)")
    s.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's draws")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    s.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--record", metavar="DIR", default=None,
                     help="write the run directory (requests.jsonl, iterations.jsonl, trace.json, config.json, "
                          "metrics.prom; see docs/run-directory.md) to DIR")
    _add_engine_args(gen)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (docs/server.md)",
                         description="Serve the engine behind an OpenAI-compatible HTTP API: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize, "
                                     "/version. SIGTERM/SIGINT drain, then exit 0.")
    h = srv.add_argument_group("server")
    from phaselab.server.options import ServerConfig

    add_fields(h, ServerConfig, defaults={"model_name": None, "api_key": envs.API_KEY.get()})
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default: info)")
    _add_engine_args(srv)
    _add_disagg_args(srv)
    # none of these imports torch: the bench measures over HTTP, analysis reads run directories,
    # the simulator drives core's scheduler on a virtual clock
    from phaselab.analysis.diagnose_cli import add_analysis_parsers
    from phaselab.bench.bench_cli import add_bench_parser
    from phaselab.experiments.compare_cli import add_compare_parser
    from phaselab.sim.simulate_cli import add_simulate_parser
    from phaselab.experiments.plan import add_plan_parser

    add_bench_parser(sub)
    add_analysis_parsers(sub)
    add_compare_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    return parser


def _prompt_ids(tok, ns: argparse.Namespace) -> list[int]:  # type: ignore[no-untyped-def]
    """The prompt as token ids: wrapped in the chat template unless --raw or the model has none."""
    if ns.raw or tok.chat_template is None:
        return tok.encode(ns.prompt)
    text = tok.apply_chat_template([{"role": "user", "content": ns.prompt}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def cmd_generate(ns: argparse.Namespace) -> int:
    """`generate`: one prompt through an engine of either mode (make_engine), streamed to stdout."""
    _set_threads(ns, alone=True)
    from phaselab.engine.runtime_settings import runtime_settings
    from phaselab.serving_engine import make_engine

    t0 = time.monotonic()
    if ns.mode == "disagg":
        print(f"starting {ns.prefill_workers} prefill + {ns.decode_workers} decode workers on Ray ...",
              file=sys.stderr, flush=True)
    else:
        print("loading the model ...", file=sys.stderr, flush=True)
    engine: Any = make_engine(_engine_args(ns))
    try:
        if ns.mode == "disagg":
            workers = ", ".join(f"{w.name} ({w.info.run_config['machine']['torch_num_threads']} threads)"
                                for w in engine.workers.values() if w.info is not None)
            print(f"workers ready in {time.monotonic() - t0:.1f}s: {workers}; KV transport {ns.kv_transport}",
                  file=sys.stderr, flush=True)
        else:
            cfg = engine.model_config
            print(
                f"loaded {cfg.name or engine.checkpoint_path} ({engine.checkpoint_format}, {engine.dtype}"
                + (f"; {engine.linear.summary()}" if getattr(engine, "linear", None) else "") + ") in "
                f"{time.monotonic() - t0:.1f}s; policy {ns.policy}; threads {runtime_settings()}",
                file=sys.stderr, flush=True,
            )
        prompt_ids = _prompt_ids(engine.tokenizer, ns)
        engine.add_request(prompt_ids, _sampling_params(ns))
        last, printed = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.text[printed:])  # cumulative text; held-back stop-string chars come later
                sys.stdout.flush()
                printed, last = len(out.text), out
        sys.stdout.write("\n")
        if ns.record:
            engine.write_record(ns.record)
            print(f"run directory written to {ns.record} (open trace.json in https://ui.perfetto.dev)",
                  file=sys.stderr)
        if last is not None:
            m = last.metrics
            if last.finish_reason == "error":
                print(f"phaselab: error: {last.outputs[0].error}", file=sys.stderr)
                return 1
            tpot = m.tpot_s
            transfer = (f"; KV {m.kv_transfer_bytes / 2**20:.1f} MiB moved in {m.transfer_s * 1e3:.1f} ms "
                        f"({m.worker} -> {m.decode_worker})" if m.transfer_s else "")
            print(
                f"[{len(last.token_ids)} tokens, finish_reason={last.finish_reason}; prompt {len(prompt_ids)} "
                f"tokens; TTFT {(m.ttft_s or 0) * 1e3:.0f} ms (prefill {m.prefill_compute_s * 1e3:.0f} ms)"
                + (f"; TPOT {tpot * 1e3:.1f} ms ({1 / tpot:.1f} tok/s)" if tpot else "") + f"{transfer}]",
                file=sys.stderr,
            )
        return 0
    finally:
        engine.shutdown()


def _sampling_params(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from phaselab.core.sampling_params import SamplingParams

    return SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, seed=ns.sampling_seed,
        max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, stop=ns.stop, ignore_eos=ns.ignore_eos,
    )


def cmd_serve(ns: argparse.Namespace) -> int:
    _set_threads(ns)
    import logging

    from phaselab.server.app import ServerConfig, run_server, served_model_name

    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = field_values(ns, ServerConfig)
    config = ServerConfig(**{**options, "model_name": options["model_name"] or served_model_name(ns.model),
                             "api_key": options["api_key"] or None})
    disagg_config = _disagg_config(ns) if ns.mode == "disagg" else None
    return run_server(_engine_args(ns), config, host=config.host, port=config.port, log_level=ns.log_level,
                      disagg_config=disagg_config)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from phaselab.errors import PhaselabError

    try:
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "bench":
            from phaselab.bench.bench_cli import run_bench

            return run_bench(ns)
        if ns.command in ("diagnose", "timeline"):
            from phaselab.analysis.diagnose_cli import run_analysis

            if getattr(ns, "verify", False):  # reruns build engines: the layer above analysis
                from phaselab.experiments.diagnose_verify import verify_top

                return run_analysis(ns, verify_top)
            return run_analysis(ns)
        if ns.command == "compare":
            from phaselab.experiments.compare_cli import run_compare_cli

            return run_compare_cli(ns)
        if ns.command == "simulate":
            from phaselab.sim.simulate_cli import run_simulate

            return run_simulate(ns)
        if ns.command == "plan":
            from phaselab.experiments.plan import run_plan

            return run_plan(ns)
    except PhaselabError as e:
        print(f"phaselab: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
