"""Where one stream's served per-token time goes: the engine step vs everything around it.

    python benchmarks/served_c1.py --trees before=/path/to/old/checkout after=. [--rounds 2]
                                   [--prompts 4] [--input-len 512] [--output-len 128]

For each round and each tree (a phaselab checkout; trees alternate so drift on a shared machine
hits both), starts `phaselab serve` from that tree (bundled model, --num-threads 2,
OMP_WAIT_POLICY=PASSIVE, --record), drives it with `phaselab bench` at concurrency 1 (greedy,
ignore_eos, one warm-up), flushes the server's run directory and splits each decode token's time:

    step         an iteration's start -> end (schedule + prepare + forward + sample + outputs)
    forward      the model forward inside it
    gap          one decode iteration's end -> the next one's start (the engine thread between
                 steps: deltas, the hand-off to the event loop, commands)
    sent lag     a token sampled -> its bytes handed to the socket (runs beside the next step)
    ITL          consecutive tokens' socket times (token_sent_ns), as the bench's ITL

Medians (p50) and p90 in ms per tree and round, with the load average before and after each, and
the bench's own ITL p50. Writes JSON (default benchmarks/results/served_c1.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any
from _machine import cpu_model, write_json


def log(msg: str) -> None:
    print(f"[served_c1 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[int(q * (len(xs) - 1))], 3)


def split(run_dir: str) -> dict[str, Any]:
    """The per-token breakdown of a server run directory (decode-only iterations of one request)."""
    with open(os.path.join(run_dir, "iterations.jsonl")) as f:
        its = sorted((json.loads(line) for line in f), key=lambda r: r["start_ns"])
    with open(os.path.join(run_dir, "requests.jsonl")) as f:
        reqs = [json.loads(line) for line in f]
    dec = [r for r in its if r["num_prefill_tokens"] == 0 and r["num_decode_tokens"] > 0]
    gaps = [(b["start_ns"] - a["end_ns"]) / 1e6 for a, b in zip(its, its[1:])
            if a["num_prefill_tokens"] == 0 and b["num_prefill_tokens"] == 0]
    lag, itl = [], []
    for r in reqs:
        s, t = r.get("token_sampled_ns") or [], r.get("token_sent_ns") or []
        lag += [(b - a) / 1e6 for a, b in zip(s, t)]
        itl += [(b - a) / 1e6 for a, b in zip(t[1:], t[2:])]
    out: dict[str, Any] = {"decode_iterations": len(dec)}
    for name, xs in (("step", [(r["end_ns"] - r["start_ns"]) / 1e6 for r in dec]),
                     ("forward", [r["forward_ns"] / 1e6 for r in dec]),
                     ("sample", [r["sample_ns"] / 1e6 for r in dec]), ("gap", gaps), ("sent_lag", lag), ("itl", itl)):
        out[name] = {"p50": pct(xs, 0.5), "p90": pct(xs, 0.9)}
    return out


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s; see its log")


def run_one(tree: str, port: int, args: argparse.Namespace, work: str, tag: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    rec = os.path.join(work, f"srv_{tag}")
    url = f"http://127.0.0.1:{port}"
    with open(os.path.join(work, f"serve_{tag}.log"), "w") as logf:
        argv = ["phaselab", "serve", "--port", str(port), "--num-threads", str(args.threads), "--record", rec]
        # the server under a given GIL switch interval (an experiment: phaselab itself sets none)
        launch = ["-c", f"import sys, runpy; sys.setswitchinterval({args.switch_interval}); sys.argv = {argv!r}; "
                        "runpy.run_module('phaselab', run_name='__main__')"] if args.switch_interval else ["-m", *argv]
        proc = subprocess.Popen([sys.executable, *launch], env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        wait_health(url, proc)
        load_before = os.getloadavg()
        res_json = os.path.join(work, f"bench_{tag}.json")
        subprocess.run([sys.executable, "-m", "phaselab", "bench", "--base-url", url, "--concurrency", "1",
                        "--num-prompts", str(args.prompts), "--num-warmups", "1", "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(args.seed),
                        "--result-json", res_json, "--disable-progress"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        load_after = os.getloadavg()
        req = urllib.request.Request(url + "/record/flush", method="POST")
        urllib.request.urlopen(req, timeout=60).read()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    with open(res_json) as f:
        bench = json.load(f)
    out = split(rec)
    out["bench_itl_p50_ms"] = bench.get("median_itl_ms")
    out["bench_tpot_p50_ms"] = bench.get("median_tpot_ms")
    out["load_avg_before"], out["load_avg_after"] = [round(x, 2) for x in load_before], [round(x, 2) for x in load_after]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", required=True, help="NAME=PATH of phaselab checkouts, e.g. before=/tmp/old after=.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="run the server under sys.setswitchinterval(S) (default: Python's 0.005)")
    ap.add_argument("--port", type=int, default=8741)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "served_c1.json"))
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.trees]
    work = tempfile.mkdtemp(prefix="served_c1_")
    result: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
                              "switch_interval_s": args.switch_interval or sys.getswitchinterval(),
                              "OMP_WAIT_POLICY": "PASSIVE", "workload": f"concurrency 1, {args.prompts} x "
                              f"{args.input_len} -> {args.output_len}, greedy, ignore_eos, 1 warm-up",
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "note": args.note, "runs": []}
    for rnd in range(args.rounds):
        for name, path in trees:
            log(f"round {rnd + 1}/{args.rounds}: {name} ({path}), load {os.getloadavg()[0]:.1f}")
            r = run_one(path, args.port, args, work, f"{name}_{rnd}")
            r.update(tree=name, round=rnd + 1)
            result["runs"].append(r)
            log(f"  {name}: ITL p50 {r['itl']['p50']} ms (bench {r['bench_itl_p50_ms']}), step p50 {r['step']['p50']}, "
                f"gap p50 {r['gap']['p50']}, sent lag p50 {r['sent_lag']['p50']}, load {r['load_avg_after'][0]}")
            write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
