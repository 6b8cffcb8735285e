"""What a run directory's config.json records of an LLMEngine (docs/run-directory.md): the model
and how it was loaded, the linear and attention paths that ran, the options, the scheduler and
cache as resolved, the versions, the machine and its thread settings, and the ceilings when
measured. What the analysis and the simulator read back to price and rerun the run."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import torch

from phaselab.engine.runtime_settings import runtime_settings
from phaselab.model.kernels import linear_probe
from phaselab.engine.ceilings import cpu_identity


def attention_paths(engine: Any) -> dict[str, Any]:
    """The attention kernels `engine` runs (envs.DECODE_ATTN and envs.PREFILL_ATTN choose them)."""
    from phaselab.model import kernels

    runner = engine.executor
    native = bool(getattr(runner, "native_decode", False))
    prefill = getattr(runner, "prefill_mode", None)
    return {"decode": kernels.decode_attn_description() if native else "torch (gather + SDPA)",
            "prefill": "torch (SDPA)" if prefill is None else
            next(k for k, v in kernels.PREFILL_MODES.items() if v == prefill)}


def engine_run_config(engine: Any) -> dict[str, Any]:
    """config.json of a run directory: model, dtype, policy, budgets, versions, machine."""
    import phaselab

    return {
        "model": {"path": engine.checkpoint_path, "format": engine.checkpoint_format,
                  "config": dataclasses.asdict(engine.model_config)},
        "dtype": str(engine.dtype).removeprefix("torch."),
        "linear": {**linear_probe.to_json(engine.linear), **engine.linear_summary},
        "attention": attention_paths(engine),
        "worker": engine.worker,
        "role": engine.role,
        "engine_args": dataclasses.asdict(engine.args),
        "scheduler": dataclasses.asdict(engine.scheduler_config),
        "slo": ({"tbt_s": engine.scheduler_config.slo_tbt_ms / 1e3, "cost_model": engine.budget_learner.to_json()}
                if engine.budget_learner is not None else None),
        "cache": {**dataclasses.asdict(engine.cache_config),
                  "kv_cache_bytes": getattr(engine.executor, "kv_cache_bytes", None)},
        "versions": {"phaselab": phaselab.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), **cpu_identity(), **runtime_settings()},
        **({"ceilings": engine.ceilings} if engine.ceilings else {}),
    }
