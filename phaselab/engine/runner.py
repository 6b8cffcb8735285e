"""The torch executor: plan -> tensors -> one forward pass -> sampled token ids.

Every iteration runs all of its scheduled requests in ONE forward pass over a flat token batch;
only attention separates them (see model/attention.py). The KV cache is allocated once, zeroed
(padding slots of the batched decode read it; they must hold finite numbers), and never grows.
"""

from __future__ import annotations

import time

import torch

from phaselab import envs
from phaselab.core.outputs import ScheduledRequest, SchedulerOutput, StepResult
from phaselab.model import hugepages, kernels
from phaselab.model.attention import AttentionMetadata, PrefillSeq, StepTimer
from phaselab.model.llama import LlamaForCausalLM
from phaselab.model.sampler import Sampler
from phaselab.modelinfo.model_config import ModelConfig


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        sampler: Sampler,
    ) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self.dtype = dtype
        # on huge pages where the OS gives them (model/hugepages.py): decode reads the cache every step
        self.kv_caches = hugepages.zeros(
            (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim), dtype
        )
        self._workspace: torch.Tensor | None = None  # decode gather buffer (torch fallback), grown on demand
        # decodes read K/V in place through the native kernel when it builds here (model/kernels)
        self.native_decode = kernels.supports(dtype)
        if self.native_decode:  # PHASELAB_DECODE_ATTN picks or forces the decode attention part kernel
            kernels.set_decode_attn(kernels.decode_attn_mode())
        # a decode-only batch runs RoPE + K/V write + attention as one native call (bit-identical, bf16
        # and float32; PHASELAB_FUSED_DECODE=0 keeps the separate ops, for tests and comparisons)
        self.fused_decode = self.native_decode and not envs.FUSED_DECODE.off()
        # residual add + RMSNorm and SiLU * up as one native call each (kernels/elementwise.c;
        # PHASELAB_NATIVE_ELEMENTWISE=0 keeps torch's ops)
        model.native_elementwise = self.native_decode and not envs.NATIVE_ELEMENTWISE.off()
        # a fused decode step's decoder layers as one native call (kernels.decode_layers, bit-identical to
        # the layer loop on the calls above; PHASELAB_DECODE_LAYERS=0 keeps the loop)
        model.decode_layers = not envs.DECODE_LAYERS.off()
        # a decode-only step's time by kind (attention / linear / elementwise, recorded in iterations.jsonl):
        # the one native call times its kernels in C (two clock reads per kernel call), the Python layer
        # loop and the Python ends around the layers-only call time theirs (attention.StepTimer);
        # PHASELAB_STEP_TIMERS=0 turns both off
        self.step_timers = self.fused_decode and not envs.STEP_TIMERS.off()
        if self.step_timers and model.decode_layers:
            kernels.take_step_split()  # starts the C timers, from zero
        # prefill chunks through the native bf16 kernel (PHASELAB_PREFILL_ATTN picks or forces the path)
        self.prefill_mode = kernels.prefill_mode(c.head_dim) if self.native_decode and dtype == torch.bfloat16 else None

    @property
    def native_rope(self) -> bool:
        """RoPE + K/V write in one call: every attention read comes from the cache (the prefill kernel)
        and the elementwise glue is native. Derived, so switching either off (tests do) switches it."""
        return self.prefill_mode is not None and self.model.native_elementwise

    def _decode_workspace(self, num_blocks: int) -> torch.Tensor:
        if self._workspace is None or self._workspace.shape[1] < num_blocks:
            _, _, _, bs, kvh, hd = self.kv_caches.shape
            grown = max(num_blocks, 2 * self._workspace.shape[1] if self._workspace is not None else 0)
            self._workspace = torch.empty((2, grown, bs, kvh, hd), dtype=self.dtype)
        return self._workspace

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_caches.numel() * self.kv_caches.element_size()

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self.sampler.free(plan.finished_request_ids)
        result = StepResult(iteration_id=plan.iteration_id)
        if plan.is_empty:
            return result
        t0 = time.perf_counter_ns()
        input_ids, positions, meta, logits_indices, sampling = self._prepare(plan.scheduled)
        if self.step_timers and meta.fused_decode:  # a decode-only step: its split, wherever it runs
            meta.timer = StepTimer()
        t1 = time.perf_counter_ns()
        with torch.inference_mode():
            logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        t2 = time.perf_counter_ns()
        if sampling:
            token_ids, logprobs = self.sampler.sample(logits, sampling)
            for s, tok, lp in zip(sampling, token_ids, logprobs):
                result.sampled_token_ids[s.request_id] = tok
                if lp is not None:
                    result.logprobs[s.request_id] = lp
        t3 = time.perf_counter_ns()
        result.prepare_ns, result.forward_ns, result.sample_ns = t1 - t0, t2 - t1, t3 - t2
        if self.step_timers:
            native = kernels.take_step_split() if self.model.decode_layers else None
            result.split_ns = _merged(native, meta.timer.split() if meta.timer else None)
        return result

    def _prepare(self, scheduled: list[ScheduledRequest]):  # type: ignore[no-untyped-def]
        """Flatten the plan: token ids, positions, cache slots, attention metadata, logits rows."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[ScheduledRequest] = []
        for s in scheduled:
            row, n, start, table = len(input_ids), len(s.token_ids), s.start_position, s.block_ids
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + n))
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                prefills.append(PrefillSeq(row, row + n, start, torch.tensor(table, dtype=torch.long)))
            if s.sample:
                logits_indices.append(row + n - 1)
                sampling.append(s)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), prefills=prefills, block_size=bs,
                                 prefill_mode=self.prefill_mode,
                                 native_rope=self.native_rope)
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long)
            lens = torch.tensor(decode_lens, dtype=torch.long)
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
            meta.decode_block_tables = tables
            meta.decode_seq_lens = lens
            meta.native_decode = self.native_decode
            meta.fused_decode = self.fused_decode and not prefills
            if not self.native_decode:
                meta.decode_mask = (torch.arange(max_blocks * bs)[None, :] < lens[:, None])[:, None, None, :]
                meta.decode_workspace = self._decode_workspace(len(decode_rows) * max_blocks)
        # every row samples (a decode-only step): all of them, in order, with no gather copies
        all_rows = len(logits_indices) == len(input_ids)
        return (
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            None if all_rows else torch.tensor(logits_indices, dtype=torch.long),
            sampling,
        )

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence (teacher forcing), written into `block_ids`.

        A test and analysis helper: the same forward pass the engine runs, all rows returned.
        """
        n = len(token_ids)
        assert len(block_ids) * self.block_size >= n
        bs = self.block_size
        slots = [block_ids[p // bs] * bs + p % bs for p in range(n)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefills=[PrefillSeq(0, n, 0, torch.tensor(block_ids, dtype=torch.long))],
            block_size=bs,
            prefill_mode=self.prefill_mode,
            native_rope=self.native_rope,
        )
        ids = torch.tensor(token_ids, dtype=torch.long)
        return self.model(ids, torch.arange(n), self.kv_caches, meta, None)

    # -- a request's KV blocks in and out (disaggregated serving, phaselab/disagg/) ----------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the K/V held in `block_ids`, in table order:
        (layers, 2, len(block_ids), block_size, kv_heads, head_dim), contiguous. Safe to call from
        another thread while a step runs, as long as no step writes these blocks (a parked
        request's blocks are never scheduled)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return self.kv_caches.index_select(2, index)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write K/V shaped like `read_blocks`' result into `block_ids` (between steps)."""
        L, two, _, bs, kvh, hd = self.kv_caches.shape
        expected = (L, two, len(block_ids), bs, kvh, hd)
        assert tuple(kv.shape) == expected, f"KV of shape {tuple(kv.shape)} for blocks shaped {expected}"
        index = torch.tensor(block_ids, dtype=torch.long)
        self.kv_caches.index_copy_(2, index, kv.to(self.kv_caches.dtype))


def _merged(*splits: dict[str, int] | None) -> dict[str, int] | None:
    """The per-kind sum of the step's splits that exist (the C call's and the Python parts'), else None."""
    present = [x for x in splits if x]
    if not present:
        return None
    return {k: sum(x.get(k, 0) for x in present) for k in ("attention", "linear", "elementwise")}
