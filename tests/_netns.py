"""Two simulated hosts on this machine: network namespaces joined by a veth pair, optionally
shaped with `tc` (tbf at a rate, netem delay). Needs root and iproute2 (`ip`, `tc`).

    with NetnsPair(rate="100mbit", delay_ms=1) as net:     # 10.<k>.0.1 <-veth-> 10.<k>.0.2
        head = net.popen("a", ["ray", "start", "--head", "--node-ip-address", net.addr["a"], ...])
        net.run("b", ["ping", "-c1", net.addr["a"]])
    # every process started with popen is killed, the namespaces (and so the veth) deleted,
    # in every outcome: normal exit, exception, or interpreter exit (atexit)

Names are unique per process and pair (`pl<pid>x<n>a`), so concurrent test runs do not collide,
and traffic stays inside the namespaces this creates. `require_netns()` raises NetnsUnavailable
saying exactly what is missing; tests turn it into a failure, never a skip.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import time
from typing import Any

_counter = itertools.count()
_live: list[NetnsPair] = []


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def require_netns() -> None:
    """Raise NetnsUnavailable (with what to do) unless namespaces and veth pairs can be made here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"{' and '.join(missing)} not found: install iproute2 "
                               "(Debian: apt-get install -y iproute2); the multi-host tests need it")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN); run the multi-host tests as root")
    probe = f"plprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}; this machine (container?) does not "
                               "allow network namespaces: grant CAP_NET_ADMIN / CAP_SYS_ADMIN")
    _ip("netns", "del", probe, check=False)


class NetnsPair:
    """Namespaces `a` and `b`, a veth between them, addresses addr["a"] / addr["b"]."""

    def __init__(self, rate: str | None = None, delay_ms: float | None = None, burst: str | None = None,
                 control: bool = False) -> None:
        """control: also a veth from this (the root) namespace to `a`, unshaped, so the test
        process reaches a server in `a` at addr["control_a"] (addr["control_root"] is this side)."""
        n = next(_counter)
        tag = f"pl{os.getpid() % 100000}x{n}"
        self.ns = {"a": tag + "a", "b": tag + "b"}
        self.dev = {"a": tag + "va", "b": tag + "vb", "control_root": tag + "cr", "control_a": tag + "ca"}
        subnet = 10 + (os.getpid() * 7 + n) % 200
        third = (2 * n) % 250
        self.addr = {"a": f"10.{subnet}.{third}.1", "b": f"10.{subnet}.{third}.2",
                     "control_root": f"10.{subnet}.{third + 1}.1", "control_a": f"10.{subnet}.{third + 1}.2"}
        self.control = control
        self.rate, self.delay_ms, self.burst = rate, delay_ms, burst
        self.procs: list[subprocess.Popen[Any]] = []
        self._up = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def __enter__(self) -> NetnsPair:
        require_netns()
        _live.append(self)
        try:
            for side in ("a", "b"):
                _ip("netns", "add", self.ns[side])
            self._up = True
            _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
            for side in ("a", "b"):
                _ip("link", "set", self.dev[side], "netns", self.ns[side])
                self.run(side, ["ip", "addr", "add", self.addr[side] + "/24", "dev", self.dev[side]])
                self.run(side, ["ip", "link", "set", self.dev[side], "up"])
                self.run(side, ["ip", "link", "set", "lo", "up"])
            if self.control:
                _ip("link", "add", self.dev["control_root"], "type", "veth", "peer", "name", self.dev["control_a"])
                _ip("link", "set", self.dev["control_a"], "netns", self.ns["a"])
                _ip("addr", "add", self.addr["control_root"] + "/24", "dev", self.dev["control_root"])
                _ip("link", "set", self.dev["control_root"], "up")
                self.run("a", ["ip", "addr", "add", self.addr["control_a"] + "/24", "dev", self.dev["control_a"]])
                self.run("a", ["ip", "link", "set", self.dev["control_a"], "up"])
            if self.rate or self.delay_ms:
                self.shape(self.rate, self.delay_ms, self.burst)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        if self._up:
            for side in ("a", "b"):
                self.kill_namespace_processes(side)
                _ip("netns", "del", self.ns[side], check=False)  # deletes the veth end inside it too
            _ip("link", "del", self.dev["control_root"], check=False)  # gone with its peer already, if any
            self._up = False
        if self in _live:
            _live.remove(self)

    # -- shaping ---------------------------------------------------------------------------------------
    def shape(self, rate: str | None, delay_ms: float | None = None, burst: str | None = None) -> None:
        """Egress of both ends: netem delay (if any) with a tbf rate limit under it. Replaces any
        previous shaping. The burst must hold a GSO segment (64 KiB) or tbf drops it."""
        for side in ("a", "b"):
            dev = self.dev[side]
            self.run(side, ["tc", "qdisc", "del", "dev", dev, "root"], check=False)
            tbf = ["tbf", "rate", rate, "burst", burst or "256kb", "latency", "200ms"] if rate else None
            if delay_ms:
                r = self.run(side, ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                                    f"{delay_ms}ms", "limit", "100000"], check=False)
                if r.returncode != 0:
                    raise NetnsUnavailable(f"tc netem failed ({r.stderr.strip()}): this kernel lacks the netem "
                                           "qdisc (CONFIG_NET_SCH_NETEM / module sch_netem), so a delay cannot be "
                                           "added here; rate shaping (tbf) works without it")
                if tbf:
                    self.run(side, ["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
            elif tbf:
                self.run(side, ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        self.rate, self.delay_ms = rate, delay_ms

    def tx_bytes(self, side: str) -> int:
        """Bytes sent so far by `side`'s end of the veth (an independent count of what crossed)."""
        out = self.run(side, ["cat", f"/sys/class/net/{self.dev[side]}/statistics/tx_bytes"]).stdout
        return int(out.strip())

    def qdisc(self, side: str = "a") -> str:
        return self.run(side, ["tc", "-s", "qdisc", "show", "dev", self.dev[side]]).stdout

    # -- processes -------------------------------------------------------------------------------------
    def run(self, side: str, cmd: list[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["ip", "netns", "exec", self.ns[side], *cmd], capture_output=True, text=True, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"in namespace {self.ns[side]}: {' '.join(cmd)} failed ({r.returncode}): "
                               f"{r.stderr.strip() or r.stdout.strip()}")
        return r

    def popen(self, side: str, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """A process in the namespace, in its own process group (killed with the pair)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[side], *cmd], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def pids(self, side: str) -> list[int]:
        r = _ip("netns", "pids", self.ns[side], check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_namespace_processes(self, side: str, sig: int = signal.SIGKILL) -> int:
        """Every process living in the namespace (the 'host' dies); returns how many were signalled."""
        pids = self.pids(side)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)

    def wait_tcp(self, side: str, host: str, port: int, timeout_s: float = 60.0) -> None:
        """Block until `host:port` accepts a TCP connection from inside namespace `side`."""
        deadline = time.monotonic() + timeout_s
        probe = f"import socket; socket.create_connection(('{host}', {port}), 2).close()"
        while time.monotonic() < deadline:
            if self.run(side, ["python3", "-c", probe], check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{host}:{port} did not accept connections from {self.ns[side]} within {timeout_s} s")


@atexit.register
def _cleanup() -> None:
    for pair in list(_live):
        pair.close()


class RayHosts:
    """A Ray head in namespace `a` (resource prefill_host) and a worker node in `b` (decode_host),
    joined over the veth with a per-run auth token; each node keeps its files in its own temp dir
    (never /tmp/ray, where other Ray instances of this machine live). Stopped by killing the
    processes in the namespaces (`ray stop` would stop every Ray on the machine)."""

    PORT = 6390

    def __init__(self, net: NetnsPair, num_cpus: int = 2, object_store_bytes: int = 256 * 2**20) -> None:
        import secrets
        import tempfile

        self.net = net
        self.address = f"{net.addr['a']}:{self.PORT}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.temp_dir = tempfile.mkdtemp(prefix="plray")
        self.num_cpus, self.object_store_bytes = num_cpus, object_store_bytes

    def start(self, timeout_s: float = 300.0) -> RayHosts:
        net = self.net
        common = ["--num-cpus", str(self.num_cpus), "--object-store-memory", str(self.object_store_bytes),
                  "--disable-usage-stats"]
        head = net.run("a", ["ray", "start", "--head", "--node-ip-address", net.addr["a"], "--port", str(self.PORT),
                             "--resources", '{"prefill_host": 100}', "--include-dashboard=false",
                             "--temp-dir", os.path.join(self.temp_dir, "a"), *common],
                       check=False, env=self.env, timeout=timeout_s)
        if head.returncode != 0:
            raise RuntimeError(f"the Ray head did not start in {net.ns['a']}:\n{head.stdout[-2000:]}{head.stderr[-3000:]}")
        worker = net.run("b", ["ray", "start", "--address", self.address, "--node-ip-address", net.addr["b"],
                               "--resources", '{"decode_host": 100}', *common],
                         check=False, env=self.env, timeout=timeout_s)
        if worker.returncode != 0:
            raise RuntimeError(f"the Ray worker node did not join from {net.ns['b']}:\n{worker.stdout[-2000:]}"
                               f"{worker.stderr[-3000:]}")
        return self

    def stop(self) -> None:
        for side in ("b", "a"):
            self.net.kill_namespace_processes(side)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def serve_disagg_on_a(net: NetnsPair, hosts: RayHosts, port: int, args: list[str], log_path: str,
                      ready_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """`phaselab serve --mode disagg` in namespace a on the Ray cluster `hosts`, prefill pinned to
    host a and decode to host b (one thread each), plus `args`; returns once /health answers 200."""
    import sys

    import httpx

    cmd = [sys.executable, "-m", "phaselab", "serve", "--host", "0.0.0.0", "--port", str(port), "--mode", "disagg",
           "--ray-address", hosts.address, "--prefill-resources", '{"prefill_host": 1}',
           "--decode-resources", '{"decode_host": 1}', "--prefill-threads", "1", "--decode-threads", "1", *args]
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = net.popen("a", cmd, stdout=log, stderr=log, env={**hosts.env, "OMP_WAIT_POLICY": "PASSIVE"})
    url = f"http://{net.addr['control_a']}:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-5000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the disaggregated server was not ready in {ready_s:.0f} s:\n{open(log_path).read()[-5000:]}")
