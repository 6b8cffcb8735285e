"""Model configuration: the architecture facts the model, the loader and the cost model share.

Pure data, no torch: the simulator and the modeled-cost counters read it too.
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
    """A Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2)."""

    architecture: str  # "llama" | "mistral" | "qwen2"
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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K plus V that one token occupies in the cache, over all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        emb = self.vocab_size * h
        return L * per_layer + emb + (0 if self.tie_word_embeddings else emb) + h

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
