"""Model configuration: the architecture facts the model, the loader, the simulator and the cost
formulas share. One type for a model the engine runs and a model the simulator prices.

Pure data, no torch. The engine runs the Llama family (Llama 2/3, SmolLM2, Mistral without sliding
window, Qwen2); the simulator's catalog also describes OPT-style models through the fields after
`name` (plain MLP, LayerNorm, biases on every linear layer, a learned position table), which the
engine refuses to run (`runnable`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phaselab.errors import UnsupportedModelError

# HF `architectures[0]` / GGUF `general.architecture` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: what the engine builds and what the cost formulas count.

    Llama family (Llama 2/3, SmolLM2, Mistral, Yi, Qwen2): gated MLP (gate, up, down: 3 matrices),
    RMSNorm, RoPE, grouped-query attention. OPT (simulator only): multi-head attention (kv heads =
    heads), plain MLP (fc1, fc2: 2 matrices, ReLU), LayerNorm with bias, biases on every linear
    layer, learned absolute positions (a table of max_position_embeddings + 2 rows), tied embeddings.
    """

    architecture: str  # "llama" | "mistral" | "qwen2" run in the engine; the simulator also knows "opt", "yi", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3-style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v carry a bias (Qwen2); for Llama/Mistral o_proj too, as in HF
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    # Shapes beyond the Llama family (the simulator's OPT entries); the engine runs only the defaults.
    mlp_matrices: int = 3  # 3: gated (gate, up, down); 2: plain (fc1, fc2)
    linear_bias: bool = False  # every linear layer carries a bias (OPT)
    norm: str = "rms"  # "rms" (weight) | "layer" (weight + bias)
    learned_position_rows: int = 0  # rows of a learned position table (OPT: max positions + 2); 0: RoPE
    # Where the figures came from (field name or "*" -> "config.json of ...", "the engine's ModelConfig");
    # read with phaselab.cost.catalog.source_of. Not compared.
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"{self.name or self.architecture}: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it"
            )
        if self.mlp_matrices not in (2, 3) or self.norm not in ("rms", "layer"):
            raise UnsupportedModelError(
                f"{self.name or self.architecture}: mlp_matrices={self.mlp_matrices} (2 or 3) and "
                f"norm={self.norm!r} ('rms' or 'layer') describe no supported model shape"
            )

    @property
    def runnable(self) -> bool:
        """The engine's model (phaselab.model.llama) can build it: a Llama-family shape it loads."""
        return (
            self.architecture in SUPPORTED_ARCHITECTURES.values() and self.mlp_matrices == 3 and self.norm == "rms"
            and not self.linear_bias and not self.learned_position_rows
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K plus V that one token occupies in the cache, over all layers:
        2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    def kv_bytes_per_token_per_gpu(self, dtype_bytes: int, tp: int) -> int:
        """Under tensor parallelism the KV heads split over the GPUs; with fewer KV heads than
        GPUs each head is replicated (vLLM's rule), so a GPU holds at least one."""
        heads = max(1, self.num_key_value_heads // tp)
        return 2 * self.num_hidden_layers * heads * self.head_dim * dtype_bytes

    def linear_macs_per_token_per_layer(self) -> int:
        """Multiply-accumulates of one token through one layer's projections (q, k, v, o, MLP)."""
        h = self.hidden_size
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + self.mlp_matrices * h * self.intermediate_size

    def num_parameters(self) -> int:
        """Every weight, norm and bias (the tensors expected_tensor_shapes lists, for a runnable model)."""
        h, i = self.hidden_size, self.intermediate_size
        norm = h if self.norm == "rms" else 2 * h
        per_layer = self.linear_macs_per_token_per_layer() + 2 * norm
        if self.linear_bias:
            per_layer += self.q_size + 2 * self.kv_size + h + (self.mlp_matrices - 1) * i + h
        elif self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
            if self.architecture != "qwen2":
                per_layer += h  # a Llama with attention_bias biases o_proj too, as HF's LlamaAttention does
        emb = self.vocab_size * h
        return (self.num_hidden_layers * per_layer + emb + (0 if self.tie_word_embeddings else emb)
                + self.learned_position_rows * h + norm)

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Memory the weights occupy (all of them, every parameter in `dtype_bytes`)."""
        return self.num_parameters() * dtype_bytes

    def describe(self) -> str:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        attn = "MHA" if kv_heads == heads else f"GQA {heads}/{kv_heads}"
        return (f"{self.name or self.architecture}: {self.num_parameters() / 1e9:.2f}B parameters, "
                f"{self.num_hidden_layers} layers, hidden {self.hidden_size}, {attn} x {self.head_dim}, "
                f"{'gated ' if self.mlp_matrices == 3 else ''}MLP {self.intermediate_size}, vocab {self.vocab_size}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read back `dataclasses.asdict` output, e.g. from a run directory's
        config.json; fields written before a field existed take its default."""
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face config.json dict; refuses what the model cannot run."""
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs and d.get("model_type") in SUPPORTED_ARCHITECTURES.values():
            arch = d["model_type"]  # configs written without `architectures` (e.g. converted from GGUF)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or d.get('model_type')!r} is not supported; phaselab runs "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)"
            )
        if arch in ("mistral", "qwen2") and d.get("sliding_window") and d.get("use_sliding_window", arch == "mistral"):
            # Mistral v0.1 declares a 4096 window; we run full attention, which equals the
            # windowed model only for contexts up to the window. Cap max_model_len there.
            window = int(d["sliding_window"])
        else:
            window = None
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        params = d.get("rope_parameters")  # transformers >= 5 moves rope settings here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in (None, "default"):
                rope_scaling = None
            elif kind != "llama3":
                raise UnsupportedModelError(
                    f"rope scaling type {kind!r} is not supported (only 'llama3'); "
                    "remove rope_scaling from config.json only if the model was trained without it"
                )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        max_pos = int(d.get("max_position_embeddings", 4096))
        if window is not None:
            max_pos = min(max_pos, window)
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            name=name,
        )
