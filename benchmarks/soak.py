"""Bounded soak: mixed valid, invalid and dropped requests against a real server; resources must
return to their baseline.

    python benchmarks/soak.py [--minutes 10] [--modes colocated disagg] [--concurrency 8]
        [--model PATH] [--out benchmarks/results/soak.json]

Per mode (`colocated`: one engine; `disagg`: 1P1D on Ray, workers on this machine) a
`phaselab serve` subprocess is warmed up, its baseline taken, then for `--minutes` clients send:

  valid     completions and chat, streamed or not, short outputs          (~60%)
  invalid   bad JSON, unknown fields, lone surrogates, over-long context,
            out-of-range values, deep nesting                            (~20%, each must be a 400)
  dropped   streams closed after their first chunks                       (~20%, aborted server-side)

After the load and a settling pause: RSS (server process and its children: Ray's processes and
workers), KV blocks in use (every worker, from /metrics) and open file descriptors (same
processes) against the baseline. What "back to baseline" means, check by check:

  kv_blocks_back_to_0        every worker's KV blocks in use are 0
  fds_back_to_baseline       open fds within +-4 of the baseline (Ray's and uvicorn's pools)
  rss_back_to_baseline       total RSS within --rss-tolerance (10%) of the baseline: the allocator
                             and the caches warm up (glibc keeps freed heap: engine tune_allocator
                             sets a 1 GiB trim threshold)
  rss_flat_over_second_half  total RSS grew at most --plateau-tolerance (2% of the baseline) from
                             mid-soak to the end of the load: warm-up plateaus, a leak keeps
                             growing (the Ray GCS's per-call task events grew ~16 MiB a minute
                             before the workers' calls stopped recording them)

RSS, USS, RssAnon (private heap) and RssShmem (a worker's touched share of Ray's object store,
bounded by its size) are recorded per process (named: `server`, `prefill-0`, `gcs_server`, ...)
at the baseline, every --sample-s during the soak, and after. Also counted: status codes,
server errors (must be 0) and requests served. Progress is printed every 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import sys
import threading
import time
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests._server_helpers import ServerProcess  # noqa: E402
from _machine import cpu_model, write_json  # noqa: E402

PROMPTS = ["The three primary colors are", "Write a haiku about the sea.", "List three prime numbers:",
           "Explain why the sky is blue in one sentence.", "Once upon a time"]


def process_label(p: psutil.Process, root_pid: int) -> str:
    """A stable name for a server process or one of its children: `server`, a disaggregated worker's
    name (PHASELAB_WORKER in its environment: `prefill-0`), Ray's `gcs_server`, `raylet`, ... (Ray's
    process titles change with the method an actor runs, so they cannot key a comparison)."""
    if p.pid == root_pid:
        return "server"
    try:
        worker = p.environ().get("PHASELAB_WORKER")
    except (psutil.AccessDenied, psutil.ZombieProcess):
        worker = None
    if worker:
        return worker
    cmd = p.cmdline()
    exe = os.path.basename(cmd[0]) if cmd else p.name()
    if exe.startswith("python") and len(cmd) > 1:  # python -u .../ray/_private/log_monitor.py
        script = next((a for a in cmd[1:] if a.endswith(".py")), cmd[-1])
        exe = os.path.basename(script).removesuffix(".py")
    return exe.split()[0] if exe else p.name()


def anon_shmem_mib(pid: int) -> tuple[float, float]:
    """(RssAnon, RssShmem) in MiB: private heap vs shared memory the process touched (a Ray worker's
    share of the object store is RssShmem, at most the store's size)."""
    anon = shmem = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) / 1024
            elif line.startswith("RssShmem:"):
                shmem = int(line.split()[1]) / 1024
    return anon, shmem


def resources(server: ServerProcess) -> dict[str, Any]:
    """RSS and USS (MiB) and open fds of the server and its children (Ray's processes and workers),
    per process (by `process_label`) and in total; KV blocks in use (every worker, from /metrics).
    USS: memory private to the process (RSS less what it shares: the model mapped from the object
    store, libraries)."""
    rss = uss = fds = 0
    by_process: dict[str, float] = {}
    uss_by_process: dict[str, float] = {}
    anon_by_process: dict[str, float] = {}
    shmem_by_process: dict[str, float] = {}
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            mem = p.memory_full_info()
            rss += mem.rss
            uss += mem.uss
            fds += p.num_fds()
            label = process_label(p, server.proc.pid)
            while label in by_process:  # two of a kind (ray::IDLE workers)
                label += "+"
            by_process[label] = round(mem.rss / 2**20, 1)
            uss_by_process[label] = round(mem.uss / 2**20, 1)
            anon, shmem = anon_shmem_mib(p.pid)
            anon_by_process[label], shmem_by_process[label] = round(anon, 1), round(shmem, 1)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
            pass
    text = httpx.get(server.url + "/metrics", timeout=60).text
    from prometheus_client.parser import text_string_to_metric_families

    blocks = sum(s.value for f in text_string_to_metric_families(text) if f.name == "phaselab_kv_cache_blocks_used"
                 for s in f.samples if s.labels.get("worker") != "router")
    return {"rss_mib": rss / 2**20, "uss_mib": uss / 2**20, "fds": fds, "kv_blocks_used": blocks,
            "processes": len(procs), "rss_mib_by_process": by_process, "uss_mib_by_process": uss_by_process,
            "anon_mib_by_process": anon_by_process, "shmem_mib_by_process": shmem_by_process}


def invalid_bodies(model: str) -> list[tuple[str, bytes]]:
    return [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", json.dumps({"model": model, "prompt": "x", "max_token": 3}).encode()),
        ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800"}' % model.encode()),
        ("/v1/completions", json.dumps({"model": model, "prompt": "x " * 5000, "max_tokens": 10}).encode()),
        ("/v1/completions", json.dumps({"model": model, "prompt": "x", "temperature": 7}).encode()),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": [], "max_tokens": 2}).encode()),
        ("/v1/chat/completions", ('{"model": "%s", "messages": %s}' % (model, "[" * 3000 + "]" * 3000)).encode()),
    ]


async def load(server: ServerProcess, model: str, minutes: float, concurrency: int, seed: int,
               counts: collections.Counter[str] | None = None) -> dict[str, Any]:
    """Mixed requests for `minutes`; returns the status counts (also kept up to date in `counts`)."""
    rng = random.Random(seed)
    counts = collections.Counter() if counts is None else counts
    deadline = time.monotonic() + minutes * 60
    bad = invalid_bodies(model)
    last_print = time.monotonic()

    async def one(http: httpx.AsyncClient) -> None:
        kind = rng.choices(["valid", "invalid", "dropped"], weights=[6, 2, 2])[0]
        prompt = rng.choice(PROMPTS)
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8])}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        try:
            if kind == "invalid":
                p, raw = rng.choice(bad)
                r = await http.post(p, content=raw, headers={"content-type": "application/json"})
                counts[f"invalid_{r.status_code}"] += 1
            elif kind == "dropped":
                async with http.stream("POST", path, json={**body, "max_tokens": 64, "ignore_eos": True,
                                                           "stream": True}) as r:
                    counts[f"dropped_{r.status_code}"] += 1
                    async for _ in r.aiter_bytes():
                        break  # first chunk, then the client goes away
            else:
                stream = rng.random() < 0.5
                if stream:
                    async with http.stream("POST", path, json={**body, "stream": True}) as r:
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    r = await http.post(path, json=body)
                counts[f"valid_{r.status_code}"] += 1
        except httpx.HTTPError as e:
            counts[f"client_error_{type(e).__name__}"] += 1

    async def worker() -> None:
        nonlocal last_print
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            while time.monotonic() < deadline:
                await one(http)
                if time.monotonic() - last_print > 30:
                    last_print = time.monotonic()
                    left = max(0.0, deadline - time.monotonic())
                    print(f"  {sum(counts.values())} requests, {left / 60:.1f} min left: {dict(counts)}",
                          file=sys.stderr, flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return dict(counts)


def soak_mode(mode: str, ns: argparse.Namespace) -> dict[str, Any]:
    args = ["--dtype", ns.dtype, "--kv-cache-memory", "256MiB", "--max-model-len", "256", "--max-num-seqs", "16"]
    if ns.model:
        args += ["--model", ns.model, "--served-model-name", "m"]
    if mode == "disagg":
        args += ["--mode", "disagg", "--prefill-threads", "1", "--decode-threads", "1"]
    model = "m" if ns.model else "smollm2-135m"
    print(f"[{mode}] starting the server ...", file=sys.stderr, flush=True)
    server = ServerProcess(*args).wait_ready(600)
    try:
        asyncio.run(load(server, model, ns.warmup_minutes, ns.concurrency, seed=1))  # warm caches and pools
        time.sleep(ns.settle_s)
        baseline = resources(server)
        print(f"[{mode}] baseline {baseline}; soaking {ns.minutes} min ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        live: collections.Counter[str] = collections.Counter()
        samples = [{"t_s": 0.0, "requests": 0, **baseline}]
        done = threading.Event()

        def sample() -> None:  # resources over the soak: a leak grows, a warm-up plateaus
            while not done.wait(ns.sample_s):
                try:
                    r = resources(server)
                except httpx.HTTPError:
                    continue
                samples.append({"t_s": round(time.monotonic() - t0, 1), "requests": sum(live.values()), **r})
                big = {k: v for k, v in r["rss_mib_by_process"].items()
                       if v - baseline["rss_mib_by_process"].get(k, 0) > 2}
                print(f"  [{mode}] RSS {r['rss_mib']:.0f} MiB (baseline {baseline['rss_mib']:.0f}), grown: {big}",
                      file=sys.stderr, flush=True)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        counts = asyncio.run(load(server, model, ns.minutes, ns.concurrency, seed=2, counts=live))
        elapsed = time.monotonic() - t0
        done.set()
        sampler.join()
        peak_during = resources(server)
        time.sleep(ns.settle_s)
        after = resources(server)
        log = server.log()
    finally:
        rc = server.stop(120)
    server_errors = sum(v for k, v in counts.items() if k.split("_")[-1].startswith("5") and "503" not in k)
    invalid_not_400 = sum(v for k, v in counts.items() if k.startswith("invalid_") and k != "invalid_400")
    mid = min(samples, key=lambda r: abs(r["t_s"] - elapsed / 2))  # the sample nearest mid-soak
    second_half_growth = peak_during["rss_mib"] - mid["rss_mib"]
    checks = {
        "kv_blocks_back_to_0": after["kv_blocks_used"] == 0,
        "fds_back_to_baseline": abs(after["fds"] - baseline["fds"]) <= 4,
        "rss_back_to_baseline": after["rss_mib"] <= baseline["rss_mib"] * (1 + ns.rss_tolerance),
        "rss_flat_over_second_half": second_half_growth <= baseline["rss_mib"] * ns.plateau_tolerance,
        "no_server_errors": server_errors == 0,
        "invalid_all_400": invalid_not_400 == 0,
        "exit_code_0": rc == 0,
    }
    row = {"mode": mode, "minutes": ns.minutes, "elapsed_s": elapsed, "requests": sum(counts.values()),
           "counts": counts, "baseline": baseline, "end_of_load": peak_during, "after_settle": after,
           "rss_growth_mib": after["rss_mib"] - baseline["rss_mib"],
           "rss_mid_soak_mib": mid["rss_mib"], "rss_mid_soak_t_s": mid["t_s"],
           "rss_growth_second_half_mib": second_half_growth,
           "rss_growth_mib_by_process": {k: round(v - baseline["rss_mib_by_process"].get(k, 0.0), 1)
                                         for k, v in after["rss_mib_by_process"].items()},
           "uss_growth_mib_by_process": {k: round(v - baseline["uss_mib_by_process"].get(k, 0.0), 1)
                                         for k, v in after["uss_mib_by_process"].items()},
           "anon_growth_mib_by_process": {k: round(v - baseline["anon_mib_by_process"].get(k, 0.0), 1)
                                          for k, v in after["anon_mib_by_process"].items()},
           "shmem_growth_mib_by_process": {k: round(v - baseline["shmem_mib_by_process"].get(k, 0.0), 1)
                                           for k, v in after["shmem_mib_by_process"].items()},
           "samples": samples,
           "checks": checks, "ok": all(checks.values()),
           "tracebacks_in_log": log.count("Traceback")}
    keys = ("requests", "rss_growth_mib", "rss_growth_second_half_mib", "checks")
    print(f"[{mode}] {json.dumps({k: row[k] for k in keys})}",
          file=sys.stderr, flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=0.5)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=30.0, help="resources are sampled this often during the soak")
    ap.add_argument("--modes", nargs="+", default=["colocated", "disagg"], choices=["colocated", "disagg"])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth over baseline (fraction)")
    ap.add_argument("--plateau-tolerance", type=float, default=0.02,
                    help="allowed RSS growth from mid-soak to the end of the load (fraction of the baseline)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "soak.json"))
    ns = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows = [soak_mode(m, ns) for m in ns.modes]
    out = {"machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
           "config": vars(ns), "modes": rows, "ok": all(r["ok"] for r in rows)}
    write_json(ns.out, out)
    print(f"wrote {ns.out}; {'OK' if out['ok'] else 'FAILED: ' + str([r['checks'] for r in rows])}", file=sys.stderr)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
