"""Catalogs of the simulator: accelerators, links and models, each figure with its source.

    HardwareSpec  one accelerator (or this CPU): peak dense FLOP/s, memory bandwidth, memory size,
                  the link its tensor-parallel group uses, and the default cost parameters
    LinkSpec      one interconnect: bandwidth per direction, latency, whether it scales with GPUs
    MODELS        models as phaselab.modelinfo.model_config.ModelConfig, the engine's own type (Llama family,
                  OPT, any Hugging Face config.json): layers, widths, heads, KV heads, MLP shape, biases

Every number carries where it came from in `sources` (field name -> "datasheet: ...",
"measured: ...", "fitted on run ...", "default: ..."); `source_of(spec, field)` reads it, and a
field without an entry is a "default". Plain data, no I/O: `model_from_hf_config` takes the dict,
not the file.

Units: bytes, bytes per second, FLOP per second, seconds. "GB" in a source string means 10^9
bytes, "GiB" 2^30.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, TypeVar

from phaselab.errors import ConfigError, UnsupportedModelError
from phaselab.modelinfo.model_config import ModelConfig

GiB = 2**30
_Entry = TypeVar("_Entry")


def source_of(spec: Any, name: str) -> str:
    """Where the value of field `name` of a catalog entry came from."""
    return str(getattr(spec, "sources", {}).get(name, "default"))


# -- links -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth: float = field(metadata={"help": "bytes/s per direction of one port"})
    latency_s: float = field(metadata={"help": "one-way latency of a message, software stack included"})
    per_gpu: bool = field(default=True, metadata={
        "help": "each GPU of an instance has its own port (NVLink, PCIe, GPUDirect InfiniBand): an instance "
                "of tp GPUs moves tp x bandwidth; False: one port per instance (a host's Ethernet NIC)"})
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict, compare=False)


def _link(name: str, gbps_bytes: float, latency_s: float, per_gpu: bool, description: str,
          bw_source: str, lat_source: str) -> LinkSpec:
    return LinkSpec(name, gbps_bytes * 1e9, latency_s, per_gpu, description,
                    {"bandwidth": bw_source, "latency_s": lat_source})


LINKS: dict[str, LinkSpec] = {link.name: link for link in (
    _link("nvlink3", 300, 3e-6, True, "NVLink 3 (A100): 12 links x 50 GB/s = 600 GB/s per GPU, both directions",
          "datasheet: NVIDIA A100, 600 GB/s bidirectional per GPU -> 300 GB/s per direction",
          "default: NVLink + NCCL small-message latency, order of magnitude"),
    _link("nvlink4", 450, 3e-6, True, "NVLink 4 (H100/H200): 18 links, 900 GB/s per GPU, both directions",
          "datasheet: NVIDIA H100 SXM, 900 GB/s bidirectional per GPU -> 450 GB/s per direction",
          "default: NVLink + NCCL small-message latency, order of magnitude"),
    _link("pcie4", 32, 2e-6, True, "PCIe 4.0 x16",
          "datasheet: PCIe 4.0 x16, 16 GT/s x 16 lanes = ~32 GB/s per direction",
          "default: PCIe round trip ~1-2 us"),
    _link("pcie5", 64, 2e-6, True, "PCIe 5.0 x16",
          "datasheet: PCIe 5.0 x16, 32 GT/s x 16 lanes = ~64 GB/s per direction",
          "default: PCIe round trip ~1-2 us"),
    _link("ib-hdr", 25, 5e-6, True, "InfiniBand HDR, one 200 Gb/s NIC per GPU (GPUDirect RDMA)",
          "datasheet: HDR 200 Gb/s = 25 GB/s per direction", "default: RDMA verbs ~1-2 us + software"),
    _link("ib-ndr", 50, 5e-6, True, "InfiniBand NDR, one 400 Gb/s NIC per GPU (GPUDirect RDMA)",
          "datasheet: NDR 400 Gb/s = 50 GB/s per direction", "default: RDMA verbs ~1-2 us + software"),
    _link("25gbe", 3.125, 50e-6, False, "25 Gb/s Ethernet, one NIC per instance (TCP)",
          "datasheet: 25 Gb/s = 3.125 GB/s per direction", "default: TCP within a rack, tens of us"),
    _link("100gbe", 12.5, 30e-6, False, "100 Gb/s Ethernet, one NIC per instance (TCP)",
          "datasheet: 100 Gb/s = 12.5 GB/s per direction", "default: TCP within a rack, tens of us"),
)}


# -- hardware --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: float = field(metadata={"help": "dense bf16/fp16 tensor FLOP/s of one device (no sparsity)"})
    mem_bandwidth: float = field(metadata={"help": "device memory bandwidth, bytes/s"})
    memory_bytes: int = field(metadata={"help": "device memory, bytes"})
    tp_link: str = field(default="nvlink4", metadata={
        "help": "LINKS entry (or link file) of the tensor-parallel group"})
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    cost_params: dict[str, Any] | None = field(default=None, compare=False, metadata={
        "help": "CostParams fields of a device read from a file (catalog_files.py); None: the catalog's defaults"})
    host: dict[str, Any] | None = field(default=None, compare=False, metadata={
        "help": "a measured CPU's identity (cpu_model, isa, hostname, measured_at, load average, threads, dtype; "
                "phaselab/engine/ceilings.py): calibrate warns when a run names another CPU"})


HARDWARE: dict[str, HardwareSpec] = {h.name: h for h in (
    HardwareSpec("a100", 312e12, 2.039e12, 80 * GiB, "nvlink3", "NVIDIA A100 80GB SXM", {
        "peak_flops": "datasheet: A100 SXM, 312 TFLOPS dense BF16 tensor core",
        "mem_bandwidth": "datasheet: A100 80GB SXM, 2,039 GB/s HBM2e",
        "memory_bytes": "datasheet: 80 GB HBM2e (81920 MiB as nvidia-smi reports it)"}),
    HardwareSpec("h100", 989.4e12, 3.35e12, 80 * 10**9, "nvlink4", "NVIDIA H100 SXM5 80GB", {
        "peak_flops": "datasheet: H100 SXM, 989 TFLOPS dense BF16 (1,979 with sparsity)",
        "mem_bandwidth": "datasheet: H100 SXM, 3.35 TB/s HBM3",
        "memory_bytes": "datasheet: 80 GB HBM3"}),
    HardwareSpec("h200", 989.4e12, 4.8e12, 141 * 10**9, "nvlink4", "NVIDIA H200 SXM 141GB", {
        "peak_flops": "datasheet: H200 SXM, 989 TFLOPS dense BF16 (same compute as H100 SXM)",
        "mem_bandwidth": "datasheet: H200, 4.8 TB/s HBM3e",
        "memory_bytes": "datasheet: 141 GB HBM3e"}),
    # A documented default, not this host: 2 cores of the Intel Xeon (Sapphire Rapids family, AVX512-BF16, no
    # AMX exposed) an earlier session ran on, from `python benchmarks/roofline.py --quick` there. The host
    # changes between sessions (an AMD EPYC runs the same GEMMs 1.2-1.9x faster), so `phaselab simulate
    # calibrate` bounds its fit by the ceilings measured on the run's own host (phaselab/engine/ceilings.py,
    # recorded in the run directory) and warns when it falls back to this entry for a run of another CPU.
    HardwareSpec("cpu", 180e9, 27.7e9, 23 * GiB, "pcie4", "an earlier session's CPU (2 cores), as measured there", {
        "peak_flops": "measured: benchmarks/results/roofline.json (quiet machine, 2 threads), the fastest bf16 "
                      "GEMM of the bundled model's shapes, 179.7 GFLOP/s (o_proj at 2048 rows)",
        "mem_bandwidth": "measured: benchmarks/results/roofline.json (quiet machine), read bandwidth of a 1 GiB "
                         "array, 27.7 GB/s",
        "memory_bytes": "measured: free -g, 23 GiB",
        "tp_link": "default: unused (one device)"},
        host={"cpu_model": "Intel Xeon (Sapphire Rapids family; its model name was not recorded)",
              "isa": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"], "cpu_capability": "AVX512",
              "threads": 2, "dtype": "bfloat16", "model": "smollm2-135m",
              "measured_at": "2026-11-30T12:58:27 (benchmarks/results/roofline.json)"}),
)}
HARDWARE_ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "h200-sxm": "h200", "this-cpu": "cpu"}


def get_hardware(name: str) -> HardwareSpec:
    """A catalog entry by name, or a hardware JSON file (catalog_files.py)."""
    from phaselab.cost import catalog_files

    if catalog_files.is_file_ref(name):
        return catalog_files.load_hardware(name)
    return _lookup(HARDWARE, HARDWARE_ALIASES, name, "hardware")


def get_link(name: str) -> LinkSpec:
    """A catalog link by name, or a link JSON file (catalog_files.py)."""
    from phaselab.cost import catalog_files

    if catalog_files.is_file_ref(name):
        return catalog_files.load_link(name)
    return _lookup(LINKS, {"nvlink": "nvlink4", "ib": "ib-ndr", "infiniband": "ib-ndr", "ethernet": "25gbe"},
                   name, "link")


def _lookup(table: dict[str, _Entry], aliases: dict[str, str], name: str, kind: str) -> _Entry:
    key = name.strip().lower()
    key = aliases.get(key, key)
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ConfigError(f"unknown {kind} {name!r}{hint}; the catalog has {', '.join(sorted(table))}, or pass a "
                      f"{kind} JSON file (docs/simulator.md, 'Adding a device from a file')")


# -- models ----------------------------------------------------------------------------------------------
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "yi", "gemma", "internlm2", "deepseek")


def model_from_hf_config(d: dict[str, Any], name: str = "") -> ModelConfig:
    """A ModelConfig for the simulator from a Hugging Face config.json dict: OPT, the Llama family, and any decoder
    whose config names hidden_size / num_hidden_layers / num_attention_heads /
    intermediate_size (a gated MLP is assumed then, and said so in `sources`)."""
    model_type = str(d.get("model_type", "")).lower()
    archs = d.get("architectures") or []
    name = name or d.get("_name_or_path") or model_type or "model"
    source = f"config.json of {name}"
    try:
        if model_type == "opt" or any(a.startswith("OPT") for a in archs):
            h = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            if int(d.get("word_embed_proj_dim", h)) != h:
                source += " (word_embed_proj_dim differs: its small projections are not counted)"
            max_pos = int(d.get("max_position_embeddings", 2048))
            return ModelConfig(
                name=name, architecture="opt", num_hidden_layers=int(d["num_hidden_layers"]), hidden_size=h,
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=h // heads,
                intermediate_size=int(d["ffn_dim"]),
                vocab_size=int(d["vocab_size"]), mlp_matrices=2,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                linear_bias=bool(d.get("enable_bias", True)), norm="layer", learned_position_rows=max_pos + 2,
                max_position_embeddings=max_pos, sources={"*": source})
        h = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        known = model_type in LLAMA_FAMILY or any(a.endswith("ForCausalLM") and a.lower().startswith(LLAMA_FAMILY)
                                                  for a in archs)
        if not known:
            source += f" (model_type {model_type!r} not in the catalog's families: gated MLP and RMSNorm assumed)"
        return ModelConfig(
            name=name, architecture=model_type or "llama", num_hidden_layers=int(d["num_hidden_layers"]),
            hidden_size=h, num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or h // heads), intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)), sources={"*": source})
    except KeyError as e:
        raise UnsupportedModelError(
            f"config.json of {name!r} lacks {e.args[0]!r}; the simulator needs hidden_size, num_hidden_layers, "
            "num_attention_heads and intermediate_size (or ffn_dim)") from None


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, max_pos: int,
           source: str, tie: bool = False, qkv_bias: bool = False, arch: str = "llama") -> ModelConfig:
    return ModelConfig(name=name, architecture=arch, num_hidden_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tie, attention_bias=qkv_bias,
                       max_position_embeddings=max_pos, sources={"*": source})


def _opt(name: str, layers: int, hidden: int, heads: int, vocab: int = 50272) -> ModelConfig:
    return ModelConfig(name=name, architecture="opt", num_hidden_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                       intermediate_size=4 * hidden, vocab_size=vocab, mlp_matrices=2, tie_word_embeddings=True,
                       linear_bias=True, norm="layer", learned_position_rows=2050, max_position_embeddings=2048,
                       sources={"*": f"config.json of facebook/{name}"})


MODELS: dict[str, ModelConfig] = {m.name: m for m in (
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, "config.json of meta-llama/Meta-Llama-3-8B"),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, "config.json of meta-llama/Meta-Llama-3-70B"),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, "config.json of meta-llama/Llama-2-70b-hf"),
    _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768, "config.json of mistralai/Mistral-7B-v0.1",
           arch="mistral"),
    _llama("yi-34b", 60, 7168, 56, 8, 20480, 64000, 4096, "config.json of 01-ai/Yi-34B"),
    _llama("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, 32768, "config.json of Qwen/Qwen2-7B", qkv_bias=True,
           arch="qwen2"),
    _llama("qwen2-72b", 80, 8192, 64, 8, 29568, 152064, 32768, "config.json of Qwen/Qwen2-72B", qkv_bias=True,
           arch="qwen2"),
    _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, "config.json of HuggingFaceTB/SmolLM2-135M-Instruct "
           "(the bundled model)", tie=True),
    _opt("opt-13b", 40, 5120, 40),
    _opt("opt-66b", 64, 9216, 72),
    _opt("opt-175b", 96, 12288, 96),
)}


def get_model(name: str) -> ModelConfig:
    return _lookup(MODELS, {"llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b", "llama2-70b": "llama-2-70b",
                            "yi-34": "yi-34b", "qwen2-72": "qwen2-72b"}, name, "model")


def gib(n_bytes: float) -> float:
    return n_bytes / GiB

