"""Prefill and decode speed of phaselab next to Hugging Face transformers, in one process run.

    python benchmarks/engine_core.py [--dtypes float32 bfloat16] [--trials 3] [--out benchmarks/results/engine_core.json]

Figures (medians of --trials, with min/max):
  prefill tokens/s for a 512-token prompt (one forward pass that fills the cache),
  decode ms/step at batch 1 and 32 with 512-token contexts.
Both engines run the same weights (the bundled GGUF, dequantized) in the same process, one after
the other, so the ratio is meaningful on a noisy shared machine; absolute times drift.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from phaselab import LLM, SamplingParams  # noqa: E402
from phaselab.model.loader import default_model_path  # noqa: E402

DECODE_STEPS = 16


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def prompt_ids(seed: int, n: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def phaselab_prefill(llm: LLM, n: int, trial: int) -> float:
    out = llm.generate([prompt_ids(1000 + trial, n)], SamplingParams(temperature=0, max_tokens=1))[0]
    return n / out.metrics.prefill_compute_s


def phaselab_decode(llm: LLM, batch: int, ctx: int, trial: int) -> float:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 2, ignore_eos=True)
    for i in range(batch):
        eng.add_request(prompt_ids(10_000 * (trial + 1) + i, ctx), params)
    times = []
    while eng.has_unfinished_requests():
        plan_before = eng.scheduler.num_running
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        # count only pure-decode iterations with the whole batch running
        if plan_before == batch and eng.last_plan is not None and eng.last_plan.num_prefill_tokens == 0 and len(outs) == batch:
            times.append(dt)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def hf_prefill(model, n: int, trial: int) -> float:
    ids = torch.tensor([prompt_ids(1000 + trial, n)])
    t0 = time.perf_counter()
    model(ids, use_cache=True)
    return n / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_decode(model, batch: int, ctx: int, trial: int) -> float:
    ids = torch.tensor([prompt_ids(10_000 * (trial + 1) + i, ctx) for i in range(batch)])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=past, use_cache=True)
        times.append(time.perf_counter() - t0)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/engine_core.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    results: dict = {
        "benchmark": "engine_core",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
        "model": path,
        "decode_context": args.context,
        "dtypes": {},
    }
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        print(f"[{dtype_name}] loading phaselab and transformers ...", file=sys.stderr, flush=True)
        llm = LLM(dtype=dtype_name, kv_cache_memory="4GiB", max_model_len=4096, enable_prefix_caching=False)
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=dtype).eval()
        r: dict = {"prefill_tokens_per_s": {}, "decode_ms_per_step": {}}
        n = args.prefill_tokens
        phaselab_prefill(llm, n, 99)  # warm-up
        hf_prefill(hf, n, 99)
        ours = [phaselab_prefill(llm, n, t) for t in range(args.trials)]
        ref = [hf_prefill(hf, n, t) for t in range(args.trials)]
        r["prefill_tokens_per_s"][str(n)] = {"phaselab": stats(ours), "transformers": stats(ref),
                                             "ratio_phaselab_over_hf": statistics.median(ours) / statistics.median(ref)}
        print(f"[{dtype_name}] prefill {n}: phaselab {statistics.median(ours):.0f} tok/s, "
              f"transformers {statistics.median(ref):.0f} tok/s", file=sys.stderr, flush=True)
        for b in args.batches:
            ours = [phaselab_decode(llm, b, args.context, t) for t in range(args.trials)]
            ref = [hf_decode(hf, b, args.context, t) for t in range(args.trials)]
            r["decode_ms_per_step"][str(b)] = {"phaselab": stats(ours), "transformers": stats(ref),
                                               "speedup_phaselab_over_hf": statistics.median(ref) / statistics.median(ours)}
            print(f"[{dtype_name}] decode batch {b} ctx {args.context}: phaselab {statistics.median(ours):.1f} ms/step, "
                  f"transformers {statistics.median(ref):.1f} ms/step", file=sys.stderr, flush=True)
        results["dtypes"][dtype_name] = r
        del llm, hf
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
