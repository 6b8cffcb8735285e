"""Starting the worker pools of disaggregated serving: Ray, one actor per worker, the handshake.

    ensure_ray ─▶ start_workers (one DisaggWorker actor per worker, threads and environment fixed
    before torch loads) ─▶ handshake_workers: model loaded?  clock offset (0 on one host)?
    KV layouts of every prefill/decode pair compatible?
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from phaselab.engine_args import EngineArgs
from phaselab.disagg.disagg_config import DisaggConfig
from phaselab.disagg.connector import handshake
from phaselab.disagg.process import WorkerHandle, worker_env
from phaselab.disagg.worker import DisaggWorker
from phaselab.errors import ConfigError

# Ray's core installs an absl failure-signal handler in the driver that logs a stack and re-raises
# SIGTERM: a server then sees two SIGTERMs (drain, then abort) and may exit by SIGABRT. Read when
# `ray` is imported, so set before the first import (ray is imported lazily below).
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


def ensure_ray(address: str | None, config: DisaggConfig) -> None:
    """Join `address`, or start Ray locally (small object store, no dashboard) unless running."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # "local": a new instance of our own, never a cluster someone else started on this machine
        ray.init(address="local", num_cpus=os.cpu_count() or 1, object_store_memory=config.object_store_memory,
                 include_dashboard=False, log_to_driver=True)


def start_workers(args: EngineArgs, config: DisaggConfig, ckpt_ref: Any, prefill_overrides: dict[str, Any] | None,
                  decode_overrides: dict[str, Any] | None) -> dict[str, WorkerHandle]:
    """One actor per worker (they load their models in parallel; handshake_workers waits)."""
    import ray

    cores = os.cpu_count() or 1
    num_workers = args.prefill_workers + args.decode_workers
    default_threads = max(1, cores // num_workers)
    workers: dict[str, WorkerHandle] = {}
    remote_cls = ray.remote(DisaggWorker)
    for role, count, threads, overrides, resources in (
        ("prefill", args.prefill_workers, args.prefill_threads, prefill_overrides, config.prefill_resources),
        ("decode", args.decode_workers, args.decode_threads, decode_overrides, config.decode_resources),
    ):
        n = threads or default_threads
        wargs = dataclasses.replace(args, mode="colocated", num_threads=n, **(overrides or {}))
        for i in range(count):
            name = f"{role}-{i}"
            # enable_task_events=False: Ray's GCS otherwise keeps an event record of every call to the
            # actor (up to task_events_max_num_task_in_gcs, 100,000 by default): with a poll every
            # poll_interval_s per worker and a few calls per request, the GCS grew ~16 MiB a minute
            # (+216 MiB in a 10-minute benchmarks/soak.py run). These calls are the serving loop's
            # plumbing, not tasks anyone inspects; an option of our actors, not of the cluster.
            actor = remote_cls.options(
                num_cpus=config.worker_num_cpus, max_concurrency=16, max_restarts=0,
                resources=dict(resources) or None, runtime_env={"env_vars": worker_env(n, name)},
                enable_task_events=False,
            ).remote(name, role, wargs, config, ckpt_ref)
            workers[name] = WorkerHandle(name, role, actor)
    return workers


def handshake_workers(workers: dict[str, WorkerHandle], config: DisaggConfig, router_boot_id: str) -> None:
    """Wait for every worker's model, measure its clock offset, check every prefill/decode layout pair."""
    import ray

    refs = {w.actor.handshake.remote(): w for w in workers.values()}
    try:
        infos = ray.get(list(refs), timeout=config.worker_start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"disagg workers did not start within worker_start_timeout_s="
                          f"{config.worker_start_timeout_s:g} s (model load); is the Ray cluster big enough "
                          "(resources, memory)?") from None
    except ray.exceptions.RayTaskError as e:  # the worker's __init__ raised: show its error
        raise e.cause if isinstance(getattr(e, "cause", None), Exception) else e from None
    for w, info in zip(refs.values(), infos):
        w.info = info
        # a second, short call measures the clock offset (round trip bounds its error)
        t0 = time.monotonic_ns()
        again = ray.get(w.actor.handshake.remote(), timeout=config.worker_timeout_s)
        t1 = time.monotonic_ns()
        if again.boot_id == router_boot_id:
            w.clock_offset_ns, w.clock_error_ns = 0, 0  # one host, one boot: one monotonic clock
        else:
            w.clock_offset_ns = again.monotonic_ns - (t0 + t1) // 2
            w.clock_error_ns = (t1 - t0) // 2
    prefills = [w for w in workers.values() if w.role == "prefill"]
    for d in (w for w in workers.values() if w.role == "decode"):
        for p in prefills:
            assert p.info is not None and d.info is not None
            handshake(p.info.layout, d.info.layout, p.name, d.name)


def describe_workers(workers: dict[str, WorkerHandle]) -> dict[str, Any]:
    """config.json's view of every worker: where it ran, its clock, its last stats, its engine."""
    out = {}
    for w in workers.values():
        info = w.info
        out[w.name] = {
            "role": w.role, "alive": w.alive, "death": w.death,
            "node_id": info.node_id if info else None, "hostname": info.hostname if info else None,
            "pid": info.pid if info else None,
            "clock_offset_ns": w.clock_offset_ns, "clock_offset_error_ns": w.clock_error_ns,
            "last_stats": ({**dataclasses.asdict(w.stats), "busy_fraction": w.stats.busy_fraction}
                           if w.stats is not None else None),
            "engine": info.run_config if info else None,
        }
    return out
