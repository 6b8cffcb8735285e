"""The KV connector: moves one request's KV blocks (not Python objects) from a prefill worker's
cache to a decode worker's cache, after a handshake that checks both caches share one layout.

    prefill worker                         router                       decode worker
    ──────────────                         ──────                       ─────────────
    token sampled, request parked;
    export() under a lease ──KVSource──▶ picks a decode worker ──▶ admit(TransferSpec)
      ray-object-store: copy the blocks                              transfer thread:
      into the object store, free them    ray-object-store: ray.get(ref) ──┐ (Ray moves the bytes,
      ray-actor: keep the blocks          ray-actor: read_kv(rid) ─────────┤  across nodes too)
                                                                           ▼ end: KV staged
    release_kv(rid) ◀──────────────── ack(source): the source may free it
                                                             admission (blocks free?) ─▶
                                                             write_blocks ─▶ decode

The payload is a request's blocks in table order, `(layers, 2, num_blocks, block_size, kv_heads,
head_dim)`, the partially filled last block included: a transfer moves
`num_blocks x block_size x kv_bytes_per_token` bytes (block granularity). The K/V of the token
the prefill sampled is not in it: that token is the decode worker's first input.

A transport decides only how the bytes travel (`KVTransport`); the workers, the lease protocol
and the engines do not change with it. Two ship here:

- `ray-object-store` (default): the prefill worker copies the blocks into its node's object store
  when the request parks and frees its blocks at once; the lease then covers that copy (the
  decode worker `ray.get`s it, across nodes if need be). The transfer starts at that copy.
- `ray-actor`: the decode worker calls the prefill actor's `read_kv`; the prefill
  worker keeps the request's blocks under its lease until the ack, copies them out only when
  asked (no copy for a request that is aborted), and Ray carries the reply through its object
  store to the caller's node. It needs the (busy) prefill process to answer an RPC: the KV landed
  ~8 ms later per request than through the object store on this 2-core machine (median of
  benchmarks/disagg_interference.py, docs/disaggregation.md); the object store also frees prefill
  blocks sooner.

- `inline`: the bytes ride inside the messages (for in-process workers in tests).

Other transports (shared memory on one host, torch.distributed / NCCL on GPUs) implement the
same three methods.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch

from phaselab.errors import ConfigError, PhaselabError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVLayoutMismatchError(ConfigError):
    """Two workers' KV caches cannot exchange blocks (dtype, block size, layers, heads, head dim)."""


class KVUnavailableError(PhaselabError):
    """The source no longer holds a request's KV: its lease ended, or its worker is gone."""


@dataclass(frozen=True)
class KVLayout:
    """What must agree for a block written by one worker to be read by another."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_engine(cls, engine: Any) -> KVLayout:
        c = engine.model_config
        return cls(str(engine.dtype).removeprefix("torch."), engine.cache_config.block_size,
                   c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.torch_dtype).bits // 8

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers (= ModelConfig.kv_bytes_per_token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def handshake(source: KVLayout, destination: KVLayout, source_name: str = "prefill worker",
              destination_name: str = "decode worker") -> None:
    """Refuse to connect two workers whose KV layouts differ, naming every difference."""
    diffs = [f"{f.name}: {getattr(source, f.name)!r} on {source_name} vs {getattr(destination, f.name)!r} on "
             f"{destination_name}" for f in fields(KVLayout) if getattr(source, f.name) != getattr(destination, f.name)]
    if diffs:
        raise KVLayoutMismatchError(
            f"KV layout mismatch between {source_name} and {destination_name} ({'; '.join(diffs)}): a KV block "
            "written by one cannot be read by the other. Give both pools the same model, --dtype and "
            "--block-size.")


@dataclass
class KVSource:
    """Where one request's KV can be fetched (plain data; travels prefill -> router -> decode)."""

    transport: str
    request_id: str
    worker: str  # the prefill worker holding it
    owner: Any  # that worker's actor handle (release_kv goes there)
    layout: KVLayout
    num_tokens: int  # tokens whose K/V it holds (prompt + outputs but the last)
    num_blocks: int
    handle: Any = None  # transport-specific (ray-object-store: [ObjectRef])
    attempt: int = 0  # the prefill attempt that produced it (a re-prefill opens a new lease)
    # a transport that copies the KV out when the request parks: when that copy ran (source's clock);
    # the transfer starts there, not at the decode worker's fetch
    export_start_ns: int | None = None
    export_end_ns: int | None = None

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes


# -- payload: a torch tensor as a flat byte array (numpy: Ray ships it zero-copy) ----------------------
def pack(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().view(torch.uint8).numpy()


def unpack(data: np.ndarray, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    with warnings.catch_warnings():  # Ray hands out read-only buffers; the tensor is only read
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    expected = num_blocks * layout.block_bytes
    if raw.numel() != expected:
        raise KVUnavailableError(f"KV payload of {raw.numel()} bytes, expected {expected}")
    return raw.view(layout.torch_dtype).view(layout.shape(num_blocks))


# -- transports -----------------------------------------------------------------------------------------
class KVTransport(ABC):
    name: ClassVar[str]
    # True: the prefill worker keeps the request's blocks until the ack (the KV is read from them);
    # False: export() copied the KV out and the blocks are freed at once.
    holds_blocks: ClassVar[bool]

    @abstractmethod
    def export(self, read_blocks: Any) -> Any:
        """Prefill side, when the request parks: `read_blocks()` returns its KV tensor. Returns
        the transport handle that goes into KVSource.handle."""

    @abstractmethod
    def fetch(self, source: KVSource, timeout_s: float) -> torch.Tensor:
        """Decode side: the KV tensor, or KVUnavailableError."""

    def ack(self, source: KVSource) -> None:
        """Decode side: the KV is here; the source may free it."""
        call(source.owner.release_kv, source.request_id, "acked", source.attempt)


def call(method: Any, *args: Any) -> Any:
    """Call a worker method: `.remote()` on a Ray actor handle, directly on an in-process worker."""
    remote = getattr(method, "remote", None)
    return remote(*args) if remote is not None else method(*args)


def _unavailable(source: KVSource, e: BaseException) -> KVUnavailableError:
    import ray.exceptions as rx

    cause = e
    if isinstance(e, rx.RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, KVUnavailableError):
            return cause
    if isinstance(e, rx.GetTimeoutError):
        return KVUnavailableError(f"fetching the KV of {source.request_id} from {source.worker} timed out")
    if isinstance(e, (rx.RayActorError, rx.OwnerDiedError, rx.ObjectLostError)):
        return KVUnavailableError(f"{source.worker} is gone with the KV of {source.request_id} ({type(e).__name__})")
    return KVUnavailableError(f"fetching the KV of {source.request_id} from {source.worker} failed: {cause!r}")


class RayActorTransport(KVTransport):
    name = "ray-actor"
    holds_blocks = True

    def export(self, read_blocks: Any) -> Any:
        return None  # nothing to copy now: read_kv reads the held blocks when the decode side asks

    def fetch(self, source: KVSource, timeout_s: float) -> torch.Tensor:
        import ray

        try:
            data = ray.get(source.owner.read_kv.remote(source.request_id, source.attempt), timeout=timeout_s)
        except Exception as e:
            raise _unavailable(source, e) from e
        return unpack(data, source.layout, source.num_blocks)


class RayObjectStoreTransport(KVTransport):
    name = "ray-object-store"
    holds_blocks = False

    def export(self, read_blocks: Any) -> Any:
        import ray

        return [ray.put(pack(read_blocks()))]  # in a list: a bare ref would be resolved on the way

    def fetch(self, source: KVSource, timeout_s: float) -> torch.Tensor:
        import ray

        try:
            data = ray.get(source.handle[0], timeout=timeout_s)
        except Exception as e:
            raise _unavailable(source, e) from e
        return unpack(data, source.layout, source.num_blocks)


class InlineTransport(KVTransport):
    """The KV travels inside the messages themselves (prefill -> router -> decode). Only for small
    caches and in-process workers (tests): every hop copies it."""

    name = "inline"
    holds_blocks = False

    def export(self, read_blocks: Any) -> Any:
        return pack(read_blocks()).copy()

    def fetch(self, source: KVSource, timeout_s: float) -> torch.Tensor:
        return unpack(source.handle, source.layout, source.num_blocks)


TRANSPORTS: dict[str, type[KVTransport]] = {
    t.name: t for t in (RayObjectStoreTransport, RayActorTransport, InlineTransport)}


def make_transport(name: str) -> KVTransport:
    if name not in TRANSPORTS:
        raise ConfigError(f"unknown KV transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]()
