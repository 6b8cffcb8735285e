"""A worker's process, as the router starts and reaches it: its environment (fixed before torch
loads), the checkpoint on the wire (loaded once, mapped by every worker of a node), the boot id
that tells one host's clock from another's, and the router's handle on the actor."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from phaselab import envs
from phaselab.disagg.messages import WorkerInfo, WorkerStats


def worker_env(num_threads: int, name: str = "") -> dict[str, str]:
    """Environment of a worker process, fixed before torch loads. PHASELAB_WORKER names the worker
    (`prefill-0`): Ray's process title shows only the class and the running method, so this is how
    `ps e`, /proc/PID/environ and benchmarks/soak.py tell one worker process from another."""
    import phaselab

    root = os.path.dirname(os.path.dirname(os.path.abspath(phaselab.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    n = str(num_threads)
    # PASSIVE and no spin (GOMP_SPINCOUNT overrides the policy): the workers share the cores (cli.py)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path, envs.WORKER.name: name}


def checkpoint_to_wire(ckpt: Any) -> dict[str, Any]:
    """A loaded checkpoint as plain data whose tensors are numpy arrays: `ray.put` once, and every
    worker of a node maps the same bytes (zero-copy) instead of reading and dequantizing the file."""
    import torch

    weights = {}
    for name, t in ckpt.weights.items():
        raw = t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous()
        weights[name] = (raw.numpy(), str(t.dtype).removeprefix("torch."))
    return {"config": ckpt.config, "tokenizer": ckpt.tokenizer, "path": ckpt.path, "format": ckpt.format,
            "quant_types": ckpt.quant_types, "weights": weights}


def checkpoint_from_wire(wire: dict[str, Any]) -> Any:
    import warnings

    import torch

    from phaselab.model.checkpoint import LoadedCheckpoint

    weights = {}
    with warnings.catch_warnings():  # read-only object-store buffers: the engine only copies from them
        warnings.simplefilter("ignore", UserWarning)
        for name, (array, dtype) in wire["weights"].items():
            weights[name] = torch.from_numpy(array).view(getattr(torch, dtype))
    return LoadedCheckpoint(wire["config"], weights, wire["tokenizer"], wire["path"], wire["format"],
                            wire["quant_types"])


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return f"unknown-{socket.gethostname()}"




def current_actor() -> Any:
    import ray

    if not ray.is_initialized():
        return None  # in-process worker (tests drive the class directly)
    try:
        return ray.get_runtime_context().current_actor
    except Exception:  # noqa: BLE001 - a driver, not an actor
        return None



@dataclass
class WorkerHandle:
    """The router's view of one worker actor."""

    name: str
    role: str
    actor: Any
    info: WorkerInfo | None = None
    clock_offset_ns: int = 0  # worker clock - router clock
    clock_error_ns: int = 0
    alive: bool = True
    death: str | None = None
    stats: WorkerStats | None = None
    poll_ref: Any = None
    poll_issued_ns: int = 0
    counters: dict[str, int] = field(default_factory=dict)
