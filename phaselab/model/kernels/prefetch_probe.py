"""How far ahead the Q4_1X kernel prefetches its weight rows, measured on the model at start-up.

The best distance differs between CPUs: on the AMX Xeon 4 KiB took a batch-1 step's layers from 3.54
to 3.26 ms, where 2 KiB had streamed faster on the AVX512-BF16 EPYC. `choose` times one decode step's
layers at each candidate once the model is loaded (a synthetic matrix, or the layers' matrices
streamed alone, did not rank the distances as a real step does) and records the choice in the
linear decision (config.json; verify's reruns pin it). envs.PREFETCH_BYTES forces it.
"""

from __future__ import annotations

from typing import Any

import torch

from phaselab import envs
from phaselab.errors import ConfigError
from phaselab.model import kernels
from phaselab.model.kernels import qlinear
from phaselab.model.kernels.linear_probe import LinearDecision
from phaselab.model.kernels.linear_timing import best_in_turns
from phaselab.model.linear import PackedLinear

PREFETCH_CANDIDATES = (2048, 4096)  # bytes ahead; the first is the kernel's default


def choose(decision: LinearDecision, model: torch.nn.Module, rounds: int = 8) -> None:
    """Set how far ahead the Q4_1X kernel prefetches (envs.PREFETCH_BYTES, else measured): the model's
    decoder layers run as one decode step at one row (kernels.decode_layers, over a scratch KV cache
    of CONTEXT tokens), at each PREFETCH_CANDIDATES distance in turns, best of `rounds` (~80 ms for
    the bundled model); the faster wins by more than 1%, else the default. Streaming the layers'
    matrices alone did not rank the distances reliably (within +-3%, either way from one try to the
    next), a step's layers did (4 KiB 5-7% ahead on the AMX Xeon, three tries in three). No Q4_1X
    layers, or layers that do not run as one call: the default, unmeasured. Applied process-wide
    (an earlier engine's setting must not linger) and recorded in `decision`."""
    forced = envs.PREFETCH_BYTES.get()
    decision.prefetch_probe = {}
    if forced:
        try:
            decision.prefetch_bytes = int(forced)
            if decision.prefetch_bytes < 64:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{envs.PREFETCH_BYTES.name}={forced!r} is not a byte count; give an integer >= 64 or unset it") from None
    else:
        decision.prefetch_bytes = 0
        q41x = any(isinstance(m, PackedLinear) and m.packed.fmt == "Q4_1X" for m in model.modules())
        table = model.layer_table() if q41x and kernels.available() and hasattr(model, "layer_table") else None
        if table is not None:
            decision.prefetch_probe = _prefetch_times(model, table[0], rounds)
            default = PREFETCH_CANDIDATES[0]
            best = min(PREFETCH_CANDIDATES, key=lambda b: decision.prefetch_probe[str(b)])
            if decision.prefetch_probe[str(best)] * 1.01 < decision.prefetch_probe[str(default)]:
                decision.prefetch_bytes = best
    if qlinear.available():
        qlinear.set_prefetch(decision.prefetch_bytes)


PREFETCH_CONTEXT = 512  # tokens of scratch context the prefetch probe's decode step attends to


def _prefetch_times(model: Any, layers: Any, rounds: int) -> dict[str, float]:
    """Milliseconds of one decode step's layers at one row, per candidate distance (best of rounds)."""
    cfg, bs = model.config, 16
    dtype = model.model.layers[0].input_layernorm.weight.dtype
    context = min(PREFETCH_CONTEXT, model.rotary.cos.shape[0] - 1)  # within the RoPE table (max_model_len)
    blocks = context // bs + 1
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(cfg.num_hidden_layers, 2, blocks, bs, cfg.num_key_value_heads, cfg.head_dim,
                     generator=gen).to(dtype)
    tables = torch.arange(blocks, dtype=torch.long).view(1, -1)
    lens, slots = torch.tensor([context + 1]), torch.tensor([context])
    cos, sin = model.rotary(slots, dtype)
    attn = model.model.layers[0].self_attn
    eps = model.model.layers[0].input_layernorm.eps

    def runner(nbytes: int) -> Any:
        def run() -> None:
            qlinear.set_prefetch(nbytes)
            emb = torch.randn(1, cfg.hidden_size, generator=gen).to(dtype)
            kernels.decode_layers(layers, emb, cos, sin, kv, slots, tables, lens, attn.num_heads, attn.scale, eps)
        return run
    best = best_in_turns({str(b): runner(b) for b in PREFETCH_CANDIDATES}, rounds)
    return {k: round(v * 1e3, 3) for k, v in best.items()}
