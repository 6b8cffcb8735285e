"""Operator-level profile tables: what `phaselab simulate fit` reads.

Two formats, both the Vidur project's (github.com/microsoft/vidur, MIT; a copy of the files the
shipped GPU fits are made from is in phaselab/cost/data/vidur/ with its LICENSE and README):

- compute, `mlp.csv`: one row per (model shape, tokens, TP degree) with the median time in ms of
  each operator of one transformer layer (`time_stats.<op>.median`) and the shape in trailing
  columns: n_head, n_kv_head, n_embd, n_expanded_embd, use_gated_mlp, num_tokens,
  num_tensor_parallel_workers. Read here: the four projections (attn_pre_proj = QKV, attn_post_proj
  = O, mlp_up_proj = gate+up fused when gated, mlp_down_proj) as GEMMs with their FLOPs and bytes,
  and the norms, RoPE, activation and residual add as elementwise kernels with their bytes.
- network, `all_reduce.csv` / `send_recv.csv`: time in ms by message `size` (bytes) and
  `num_workers`, with `devices_per_node` (a collective within one node has num_workers ==
  devices_per_node; the rest crosses nodes and is skipped).

Each sample is (FLOPs, bytes, tokens, measured seconds): the fit never sees a model name.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from phaselab.errors import ConfigError
from phaselab.cost.formulas import elementwise_elements_per_token
from phaselab.modelinfo.model_config import ModelConfig

DTYPE_BYTES = 2  # the profiles are fp16/bf16
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# elementwise op -> times per layer (Vidur times one residual add; a layer runs two)
ELEMENTWISE_OPS = {"input_layernorm": 1, "post_attention_layernorm": 1, "attn_rope": 1, "mlp_act": 1, "add": 2}
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp", "num_tokens",
                 "num_tensor_parallel_workers")


@dataclass(frozen=True)
class OpSample:
    op: str
    tp: int
    num_tokens: int
    flops: float  # per GPU
    num_bytes: float  # per GPU
    time_s: float  # measured (median)
    source: str = ""


@dataclass(frozen=True)
class CollectiveSample:
    op: str  # all_reduce | send_recv
    num_workers: int
    num_bytes: int
    time_s: float
    source: str = ""


def _shape_ops(row: dict[str, str]) -> dict[str, tuple[int, int] | int]:
    """The GEMMs' (K, N) and the elementwise kernels' bytes per token, on one GPU, from a row's shape."""
    heads, kv_heads, h, i = (int(row[k]) for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd"))
    gated = str(row["use_gated_mlp"]).strip().lower() in ("true", "1")
    tp = int(row["num_tensor_parallel_workers"])
    d = h // heads
    q, kv = heads * d // tp, max(1, kv_heads // tp) * d
    up = (2 if gated else 1) * i // tp
    # the elementwise kernels' elements per token: phaselab.cost.formulas's count for this row's shape
    shape = ModelConfig(architecture="llama", vocab_size=1, hidden_size=h, intermediate_size=i, num_hidden_layers=1,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                        mlp_matrices=3 if gated else 2)
    return {"attn_pre_proj": (h, q + 2 * kv), "attn_post_proj": (q, h), "mlp_up_proj": (h, up),
            "mlp_down_proj": (i // tp, h), **elementwise_elements_per_token(shape, tp)}


def read_compute_table(path: str | Path) -> tuple[list[OpSample], list[OpSample]]:
    """GEMM and elementwise samples of a Vidur-format mlp.csv (module docstring)."""
    path = Path(path)
    gemms: list[OpSample] = []
    elementwise: list[OpSample] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in SHAPE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{path}: not an operator profile table, lacks column(s) {missing}; expected Vidur's "
                              "mlp.csv format (docs/simulator.md, 'Fitting from profiles')")
        for row in reader:
            shape = _shape_ops(row)
            t, tp = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
            for op in GEMM_OPS:
                col = f"time_stats.{op}.median"
                if not row.get(col):
                    continue
                k, n = shape[op]  # type: ignore[misc]
                gemms.append(OpSample(op, tp, t, 2.0 * t * k * n, float(k * n + t * k + t * n) * DTYPE_BYTES,
                                      float(row[col]) * 1e-3, str(path)))
            for op in ELEMENTWISE_OPS:
                col = f"time_stats.{op}.median"
                if not row.get(col):
                    continue
                per_token = shape[op]
                elementwise.append(OpSample(op, tp, t, 0.0, float(t * per_token * DTYPE_BYTES),  # type: ignore
                                            float(row[col]) * 1e-3, str(path)))
    if not gemms:
        raise ConfigError(f"{path}: no GEMM timings (columns time_stats.<op>.median for {', '.join(GEMM_OPS)})")
    return gemms, elementwise


def read_collective_table(path: str | Path, intra_node: bool = True) -> list[CollectiveSample]:
    path = Path(path)
    out: list[CollectiveSample] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = ("num_workers", "size", "collective")
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{path}: not a collective profile table, lacks column(s) {missing}; expected "
                              "Vidur's all_reduce.csv / send_recv.csv format")
        for row in reader:
            op = row["collective"]
            n = int(row["num_workers"])
            per_node = int(row.get("devices_per_node") or n)
            # all-reduce within a node: every worker on it; send/recv within a node: both ends on it
            inside = per_node >= n
            if intra_node != inside:
                continue
            out.append(CollectiveSample(op, n, int(row["size"]), float(row[f"time_stats.{op}.median"]) * 1e-3,
                                        str(path)))
    return out


VIDUR_DIR = "data/vidur"
VIDUR_COMPUTE = {  # what the shipped fits are made from (copied unchanged from Vidur, see README there)
    "a100": ("meta-llama/Llama-2-7b-hf", "codellama/CodeLlama-34b-Instruct-hf", "meta-llama/Llama-2-70b-hf"),
    "h100": ("meta-llama/Llama-2-7b-hf", "codellama/CodeLlama-34b-Instruct-hf", "meta-llama/Llama-2-70b-hf"),
}


def vidur_files(device: str) -> dict[str, list[Path]]:
    """The packaged Vidur tables of one device: compute mlp.csv files, all_reduce, send_recv."""
    if device not in VIDUR_COMPUTE:
        raise ConfigError(f"no packaged Vidur profiles for {device!r}; packaged: {', '.join(sorted(VIDUR_COMPUTE))}. "
                          "Pass your own tables: phaselab simulate fit --compute mlp.csv --all-reduce all_reduce.csv")
    root = Path(str(resources.files("phaselab.cost").joinpath(VIDUR_DIR)))
    return {"compute": [root / "compute" / device / m / "mlp.csv" for m in VIDUR_COMPUTE[device]],
            "all_reduce": [root / "network" / f"{device}_dgx" / "all_reduce.csv"],
            "send_recv": [root / "network" / f"{device}_dgx" / "send_recv.csv"]}
