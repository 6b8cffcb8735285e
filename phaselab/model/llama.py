"""Llama-family decoder as plain nn.Modules (SmolLM2, Llama 2/3, Mistral, Qwen2).

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...). At load time
`load_weights` fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (one GEMM
each instead of three/two); the HF names stay the loading contract.

The forward pass works on a flat batch of tokens from many requests (no padding): linear layers
see all T tokens of the iteration at once; only attention needs to know which token belongs to
which request, and reads/writes K/V through the paged cache (see `attention.py`).
"""

from __future__ import annotations

import ctypes
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from phaselab.errors import UnsupportedModelError
from phaselab.model import kernels
from phaselab.model.kernels import qlinear
from phaselab.model import linear as linear_mod
from phaselab.model.linear import PackedEmbedding, PackedLinear
from phaselab.model.attention import AttentionMetadata, paged_attention
from phaselab.modelinfo.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32 whatever the model dtype (as HF does), scale applied after the cast back;
        # torch's fused rms_norm computes HF's x * rsqrt(mean(x^2) + eps) in one op (bit-identical
        # here in fp32 and bf16, tested), instead of six
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_norm(self, x: torch.Tensor | None, residual: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x None: (norm(residual), residual). `native`: one call
        (kernels.add_rms_norm, the same roundings) that updates `residual` in place."""
        if native:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        if x is not None:
            residual = x + residual
        return self(residual), residual


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with llama3-style scaling when the config has it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, computed once in fp32."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables (positions, hd) in `dtype`: cast once per dtype (the same values as
        casting the looked-up rows), so a decode step pays two lookups, not two lookups and two casts."""
        if dtype == self.cos.dtype:
            return self.cos, self.sin
        cast = self._cast.get(dtype)
        if cast is None or cast[0].device != self.cos.device:
            cast = self._cast[dtype] = (self.cos.to(dtype).contiguous(), self.sin.to(dtype).contiguous())
        return cast

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(dtype)
        return cos[positions], sin[positions]  # (T, hd) each


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, hd); cos/sin: (T, hd)
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def has_o_proj_bias(config: ModelConfig) -> bool:
    return config.attention_bias and config.architecture != "qwen2"


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        # fused at load time from HF's q_proj/k_proj/v_proj
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # HF's Llama/Mistral `attention_bias` also biases o_proj; Qwen2 biases q/k/v only
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=has_o_proj_bias(config))

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, kv_heads, hd) of this layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        tm = meta.timer
        t = time.perf_counter_ns() if tm is not None else 0
        qkv = self.qkv_proj(x)
        if meta.fused_decode:
            t = tm.add("linear", t) if tm is not None else 0
            out = kernels.decode_rope_attend(qkv, cos, sin, kv_cache, meta.slot_mapping, meta.decode_block_tables,
                                             meta.decode_seq_lens, self.num_heads, self.scale)
            t = tm.add("attention", t) if tm is not None else 0
            out = self.o_proj(out)
            if tm is not None:
                tm.add("linear", t)
            return out
        if meta.native_rope:  # bf16, every read from the cache: RoPE + K/V write in one call
            q = kernels.rope_write_kv(qkv, cos, sin, kv_cache, meta.slot_mapping, self.num_heads)
            return self.o_proj(paged_attention(q, None, None, kv_cache, meta, self.scale).reshape(T, self.q_size))
        qk_size = self.q_size + self.kv_size
        # RoPE on q and k together: the heads are adjacent columns, so one pass of elementwise ops
        qk = apply_rope(qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # (T, heads, hd)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), native))

    def act(self, gate_up: torch.Tensor, native: bool = False) -> torch.Tensor:
        """SiLU(gate) * up of the fused projection (`native`: one call, kernels.silu_mul, torch's roundings)."""
        if native:
            return kernels.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, residual, cos, sin, kv_cache, meta, native=False):  # type: ignore[no-untyped-def]
        """(mlp output, residual stream): the residual add is left to the next layer's first norm
        (and the model's final one), so each add and norm is one pass (one call when `native`).
        Same values as h + attn(norm(h)), then h + mlp(norm(h)): the adds happen in the same order."""
        if residual is None:  # the first layer: the embedding is the residual stream, nothing to add yet
            h, residual = None, h
        tm = meta.timer
        t = time.perf_counter_ns() if tm is not None else 0
        x, residual = self.input_layernorm.add_norm(h, residual, native)
        if tm is not None:
            tm.add("elementwise", t)
        a = self.self_attn(x, cos, sin, kv_cache, meta)  # times its own parts
        t = time.perf_counter_ns() if tm is not None else 0
        x, residual = self.post_attention_layernorm.add_norm(a, residual, native)
        if tm is None:
            return self.mlp(x, native), residual
        t = tm.add("elementwise", t)
        gate_up = self.mlp.gate_up_proj(x)
        t = tm.add("linear", t)
        act = self.mlp.act(gate_up, native)
        t = tm.add("elementwise", t)
        out = self.mlp.down_proj(act)
        tm.add("linear", t)
        return out, residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        if not config.runnable:
            raise UnsupportedModelError(
                f"{config.describe()} is a shape only the simulator prices; the engine runs Llama-family models"
            )
        self.config = config
        self.model = LlamaModel(config)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # set by linear.install on the native paths: the LM head over packed weights
        self.head: nn.Module | None = None
        # elementwise glue through kernels/elementwise.c (set by the runner where it applies)
        self.native_elementwise = False
        # a fused decode step's layers in one native call (kernels.decode_layers; set by the runner)
        self.decode_layers = False
        self._layer_table: tuple[ctypes.Array, tuple[PackedLinear, ...]] | None | bool = False  # False: not built
        self._ends: dict[torch.dtype, tuple[kernels.DecodeEnds, tuple[torch.Tensor, ...]] | None] = {}
        self._native_rows: tuple[int, int] = (-1, 0)  # (linear.native_rows_version, rows)

    def layer_table(self) -> tuple[ctypes.Array, tuple[PackedLinear, ...]] | None:
        """The decoder layers' weights for kernels.decode_layers and their linear modules, or None
        where the layers cannot run as one call (weights dequantized for torch: no packed blocks;
        norms of differing eps). Built once: the weights do not move after load."""
        if self._layer_table is False:
            self._layer_table = None
            layers = self.model.layers
            linears = [(m.self_attn.qkv_proj, m.self_attn.o_proj, m.mlp.gate_up_proj, m.mlp.down_proj) for m in layers]
            eps = {n.eps for m in layers for n in (m.input_layernorm, m.post_attention_layernorm)}
            if all(isinstance(x, PackedLinear) for four in linears for x in four) and len(eps) == 1:
                table = (kernels.DecodeLayer * len(layers))()
                for entry, layer, four in zip(table, layers, linears):
                    for i, x in enumerate(four):
                        entry.fmt[i] = qlinear.FORMAT_IDS[x.packed.fmt]
                        entry.w[i] = x.packed.data.data_ptr()
                        entry.n[i], entry.k[i] = x.out_features, x.in_features
                        entry.bias[i] = None if x.bias_f32 is None else x.bias_f32.data_ptr()
                    entry.norm_in = layer.input_layernorm.weight.data_ptr()
                    entry.norm_post = layer.post_attention_layernorm.weight.data_ptr()
                self._layer_table = (table, tuple(x for four in linears for x in four))
        return self._layer_table

    def native_rows(self) -> int:
        """The most rows every decoder layer's linear runs on the native kernel (their smallest
        max_native_rows; 0 when the layers cannot run as one call), cached until any layer's limit is
        set again (linear.native_rows_version)."""
        version, rows = self._native_rows
        if version != linear_mod.native_rows_version:
            table = self.layer_table()
            rows = min((m.max_native_rows for m in table[1]), default=0) if table is not None else 0
            self._native_rows = (linear_mod.native_rows_version, rows)
        return rows

    def decode_ends(self, dtype: torch.dtype) -> kernels.DecodeEnds | None:
        """The embedding, RoPE tables, final norm and LM head as kernels.decode_forward reads them, for
        activations of `dtype`; None where the ends cannot run natively (a dense embedding in another
        dtype, an unpacked or biased head, a final norm whose eps differs from the layers'). Built
        once per dtype: the tensors do not move after load."""
        if dtype not in self._ends:
            self._ends[dtype] = None
            emb, head, norm = self.model.embed_tokens, self.head, self.model.norm
            if isinstance(emb, PackedEmbedding) and emb.act_dtype == dtype:
                emb_fmt, emb_w, vocab_in = emb.packed.fmt, emb.packed.data, emb.num_embeddings
            elif isinstance(emb, nn.Embedding) and emb.weight.dtype == dtype and emb.weight.is_contiguous():
                emb_fmt, emb_w, vocab_in = ("BF16" if dtype == torch.bfloat16 else "F32"), emb.weight, emb.num_embeddings
            else:
                return None
            if (not isinstance(head, PackedLinear) or head.bias_f32 is not None or norm.weight.dtype != dtype
                    or norm.eps != self.model.layers[0].input_layernorm.eps or dtype not in (torch.bfloat16, torch.float32)):
                return None
            cos, sin = self.rotary.tables(dtype)
            ends = kernels.DecodeEnds(qlinear.FORMAT_IDS[emb_fmt], emb_w.data_ptr(), vocab_in, cos.data_ptr(),
                                      sin.data_ptr(), cos.shape[0], norm.weight.data_ptr(),
                                      qlinear.FORMAT_IDS[head.packed.fmt], head.packed.data.data_ptr(), head.out_features)
            self._ends[dtype] = (ends, (emb_w, cos, sin, norm.weight, head.packed.data))  # kept alive with it
        entry = self._ends[dtype]
        return None if entry is None else entry[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: torch.Tensor,  # (layers, 2, num_blocks, block_size, kv_heads, hd)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,  # rows whose logits are needed (None = all)
    ) -> torch.Tensor:
        native = self.native_elementwise
        one_call = meta.fused_decode and native and self.decode_layers
        rows = input_ids.shape[0]
        if one_call and logits_indices is None and rows <= self.native_rows():
            # a decode-only batch: embedding to logits in one native call, when the ends qualify and
            # the head too runs these rows on the kernel (decode_ends: the head is a PackedLinear)
            ends = self.decode_ends(kv_caches.dtype)
            if ends is not None and rows <= self.head.max_native_rows:
                a = self.model.layers[0].self_attn
                return kernels.decode_forward(
                    self.layer_table()[0], ends, input_ids, positions, kv_caches, meta.slot_mapping,
                    meta.decode_block_tables, meta.decode_seq_lens, a.num_heads, a.scale,
                    self.model.layers[0].input_layernorm.eps, kv_caches.dtype == torch.bfloat16)
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary(positions, h.dtype)
        residual: torch.Tensor | None = None
        table = self.layer_table() if one_call else None
        # (the layers' row limit, cached until a limit moves: tests and the start-up probe move them)
        if table is not None and h.shape[0] <= self.native_rows():
            a = self.model.layers[0].self_attn
            residual = h
            h = kernels.decode_layers(table[0], residual, cos, sin, kv_caches, meta.slot_mapping,
                                      meta.decode_block_tables, meta.decode_seq_lens, a.num_heads, a.scale,
                                      self.model.layers[0].input_layernorm.eps)
        else:
            for i, layer in enumerate(self.model.layers):
                h, residual = layer(h, residual, cos, sin, kv_caches[i], meta, native)
        assert residual is not None, "a model has at least one layer"
        if logits_indices is not None:  # only the rows that sample go through the norm and LM head (copies)
            h, residual = h[logits_indices], residual[logits_indices]
        tm = meta.timer
        t = time.perf_counter_ns() if tm is not None else 0
        h, _ = self.model.norm.add_norm(h, residual, native)
        t = tm.add("elementwise", t) if tm is not None else 0
        logits = self.head(h) if self.head is not None else F.linear(h, self.lm_head_weight)
        if tm is not None:
            tm.add("linear", t)
        return kernels.to_float(logits) if native else logits.float()  # (rows, vocab) fp32

    # -- loading ------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; strict on names and shapes."""
        from phaselab.model.checkpoint import check_tensor_shapes

        check_tensor_shapes(self.config, {k: tuple(v.shape) for k, v in weights.items()}, source)
        params = dict(self.named_parameters())

        def put(dst: str, *srcs: str) -> None:
            if dst not in params:  # held by a packed layer (linear.install)
                return
            params[dst].copy_(torch.cat([weights[s] for s in srcs], dim=0))

        put("model.embed_tokens.weight", "model.embed_tokens.weight")
        put("model.norm.weight", "model.norm.weight")
        if self.lm_head is not None:
            put("lm_head.weight", "lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            put(p + "input_layernorm.weight", p + "input_layernorm.weight")
            put(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight")
            put(a + "qkv_proj.weight", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            if self.config.attention_bias:
                put(a + "qkv_proj.bias", a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
            put(a + "o_proj.weight", a + "o_proj.weight")
            if has_o_proj_bias(self.config):
                put(a + "o_proj.bias", a + "o_proj.bias")
            put(p + "mlp.gate_up_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight")
