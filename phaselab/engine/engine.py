"""The engine loop: `step()` is schedule -> execute -> update, then turn deltas into outputs.

    add_request ──▶ tokenize ──▶ scheduler.add_request (WAITING)
    step():  plan = scheduler.schedule()          # pure Python, core/
             result = executor.execute(plan)      # torch runner (or a cost model, or a remote worker)
             deltas = scheduler.update(plan, result)
             outputs = self._process(...)         # phase stamps (recorder), detokenize, stop strings
             (the iteration record)
             self._hand_over(outputs)             # sent stamps, finished requests closed: on return

Requests join and leave between steps (continuous batching). The engine owns the clock: it reads
`time.monotonic_ns()` around each step and hands the times to its PhaseRecorder (core/recorder.py),
the same recorder the disaggregated router and the simulator drive; core never reads a clock.
Construction is two steps: `resolve()` (engine/resolve.py: pure sizing) and the model build.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from phaselab.engine_args import EngineArgs
from phaselab.engine.run_config import engine_run_config
from phaselab.engine.runtime_settings import runtime_settings, tune_allocator
from phaselab.core.executor import Executor
from phaselab.core.outputs import EngineStats, RequestDelta, SchedulerOutput, StepResult, TokenLogprobs
from phaselab.core.prompt import validate_prompt
from phaselab.core.recorder import PhaseRecorder
from phaselab.core.request import Request, RequestStatus
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.scheduler import Scheduler
from phaselab.core.timing import IterationRecord, RequestMetrics
from phaselab.engine.budget import start_learner
from phaselab.engine.ceilings import host_ceilings
from phaselab.engine.detokenizer import IncrementalDetokenizer
from phaselab.engine.request_output import CompletionOutput, RequestOutput
from phaselab.engine.resolve import resolve
from phaselab.engine.runner import ModelRunner
from phaselab.errors import InvalidRequestError
from phaselab.model.checkpoint import LoadedCheckpoint
from phaselab.model.kernels import linear_probe, prefetch_probe
from phaselab.model.linear import install as install_linear
from phaselab.model.llama import LlamaForCausalLM
from phaselab.model.loader import load_checkpoint
from phaselab.model.sampler import Sampler
from phaselab.cost.formulas import CostFormulas, StoredWeights
from phaselab.obs.prometheus import EngineMetrics
from phaselab.obs.rundir import write_run_dir
from phaselab.modelinfo.tokenizer import Tokenizer

logger = logging.getLogger("phaselab.engine")


def resolve_dtype(name: str, is_gguf: bool = True, weights: str = "auto") -> tuple[torch.dtype, str]:
    """auto: measured at start-up (linear_probe.auto_dtype: the faster dtype for decode's linear
    layers at one row and at a batched row count, on the paths `weights` allows)."""
    if name == "auto":
        return linear_probe.auto_dtype(is_gguf, native=weights != "dequantized")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name], "given"


@dataclass
class _Tracked:
    """Engine-side state of one request (the scheduler's Request holds the token counters)."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_token_ids: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, checkpoint: LoadedCheckpoint | None = None,
                 worker: str = "engine-0", role: str = "colocated", *, keep_records: bool = True,
                 closes_records: bool = True) -> None:
        args = args or EngineArgs()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        tune_allocator()
        is_gguf = linear_probe.has_gguf_blocks(args.model, checkpoint)
        self.dtype, dtype_reason = resolve_dtype(args.dtype, is_gguf, args.weights)
        self.linear = linear_probe.decide(args.weights, self.dtype, is_gguf)
        self.linear.dtype_reason = f"{str(self.dtype).removeprefix('torch.')} ({dtype_reason})"
        ckpt = checkpoint or load_checkpoint(args.model, self.dtype, args.tokenizer, self.linear.keep_packed)
        self.model_config = config = ckpt.config
        self.tokenizer: Tokenizer = ckpt.tokenizer
        self.checkpoint_path, self.checkpoint_format = ckpt.path, ckpt.format

        resolved = resolve(args, config, torch.finfo(self.dtype).bits // 8)
        self.cache_config, self.scheduler_config = resolved.cache, resolved.scheduler
        num_blocks, max_model_len = resolved.cache.num_blocks, resolved.max_model_len
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)

        model = self._build_model(ckpt, max_model_len)
        del ckpt
        self.eos_token_ids = frozenset(config.eos_token_ids) | self.tokenizer.eos_token_ids
        self.executor: Executor = ModelRunner(
            model, num_blocks, args.block_size, self.dtype, Sampler(self.eos_token_ids, seed=args.seed)
        )
        # the adaptive budget's online cost model (engine/budget.py), None under a fixed budget
        self.budget_learner = start_learner(self) if self.scheduler_config.adaptive else None
        self._tracked: dict[str, _Tracked] = {}
        self.last_plan: SchedulerOutput | None = None
        # -- the phase record (docs/metrics.md) --
        self.worker, self.role = worker, role
        self.dtype_bytes = torch.finfo(self.dtype).bits // 8
        # the records' modeled counts (cost/formulas.py), with the weights priced as this engine keeps them
        self.cost_formulas = CostFormulas(self.model_config, self.dtype_bytes,
                                          StoredWeights.from_linear(self.linear_summary))
        self.stamp_sent = True  # offline: "sent" = handed to the caller; a server stamps the socket write
        self.metrics = EngineMetrics(labels={"worker": worker, "role": role})
        # keep_records: every closed request and iteration is kept for the run directory (off: a
        # long-running server without --record only observes them); closes_records off in
        # disaggregated workers, whose requests' one record the router assembles
        self.recorder = PhaseRecorder(worker, role, keep=keep_records, closes=closes_records,
                                      on_finished=self.metrics.observe_finished, on_iteration=self._observe_iteration)
        self._seen_query_tokens = self._seen_hit_tokens = 0
        self._ids = itertools.count()
        self.ceilings: dict[str, Any] | None = None  # this host's, when measured (record_ceilings)
        if args.measure_ceilings:
            self.record_ceilings()
        logger.info(
            "engine ready: %s (%s, %s, %s; %.1f MB of weights per decode step), %d KV blocks x %d tokens, "
            "max_model_len %d, policy %s, budget %d, %s",
            config.name or self.checkpoint_path, self.checkpoint_format, self.dtype, self.linear.summary(),
            self.cost_formulas.weight_bytes(1) / 1e6, num_blocks,
            args.block_size, max_model_len, args.policy, self.scheduler_config.max_num_batched_tokens, runtime_settings(),
        )

    # -- requests --------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise InvalidRequestError (touching no state) for a prompt the engine cannot serve."""
        validate_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)

    def _build_model(self, ckpt: LoadedCheckpoint, max_model_len: int) -> LlamaForCausalLM:
        """The model step of construction: modules on the meta device, then the checkpoint's weights."""
        with torch.device("meta"):
            model = LlamaForCausalLM(ckpt.config, max_positions=max_model_len)
        weights = dict(ckpt.weights)  # install() swaps entries; a shared checkpoint stays as loaded
        self.linear_summary = install_linear(model, weights, self.linear.path, self.dtype, self.linear.max_native_rows,
                                             self.linear.batched)
        self.linear.layouts = dict(self.linear_summary.get("kernel_layouts") or {})
        model = model.to_empty(device="cpu").to(self.dtype)
        model.rotary.__init__(ckpt.config, max_model_len)  # buffers were on the meta device
        model.load_weights(weights, source=ckpt.path)
        model.eval()
        prefetch_probe.choose(self.linear, model)  # on the model's own layers, as loaded
        return model

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrived_ns: int | None = None,
        *,
        tokenized_ns: int | None = None,
        queued_ns: int | None = None,
        prompt_text: str | None = None,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request. Stamps a caller measured itself: `arrived_ns` (default now),
        `tokenized_ns` (a front that tokenized the prompt; default: when this call tokenized it),
        `queued_ns` (default now: the wait for this call counts as admission). `prompt_text`: the
        prompt's text when `prompt` is given as token ids (echoed in outputs).

        Disaggregated serving adds two options: `prefill_only` parks the request (blocks kept, see
        Scheduler.parked) once its prefill sampled a token, and `output_token_ids` resumes a
        request whose first outputs were sampled elsewhere: prompt + outputs are recomputed, then
        the next token is sampled (as after a preemption)."""
        arrived_ns = arrived_ns or time.monotonic_ns()
        params = params or SamplingParams()
        request_id = request_id or self.new_request_id()
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenize(prompt)
        tokenized_ns = tokenized_ns or time.monotonic_ns()
        self.validate_prompt(prompt_ids)
        request = Request(
            request_id, prompt_ids, params, arrival_time=arrived_ns / 1e9,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, prefill_only=prefill_only,
        )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
        if output_token_ids:
            for token_id in output_token_ids:
                request.append_output_token(token_id)
            detok.update(list(output_token_ids))
        self.scheduler.add_request(request)
        metrics = self.recorder.open(request_id, len(prompt_ids), arrived_ns=arrived_ns, tokenized_ns=tokenized_ns,
                                     queued_ns=queued_ns or time.monotonic_ns(), request=request)
        self._tracked[request_id] = _Tracked(
            request, prompt if isinstance(prompt, str) else prompt_text, detok, metrics,
            [] if params.logprobs is not None else None,
        )
        return request_id

    # -- disaggregated serving: the decode side's admission, the prefill side's release ------------
    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: torch.Tensor,
        metrics: RequestMetrics,
        admitted_ns: int | None = None,
    ) -> bool:
        """Admit a request whose K/V (of prompt + outputs but the last) come from a prefill
        worker: allocate its blocks, write `kv` (shaped like ModelRunner.read_blocks' result) into
        them, and continue decoding it from the next step. False, changing nothing, when it cannot
        be admitted now (no free blocks or seat: backpressure, retry later). Between steps only.
        `metrics` becomes this engine's record of the request (the caller stamps its KV transfer),
        decode admitted at `admitted_ns` (default: now)."""
        assert isinstance(self.executor, ModelRunner), "add_prefilled_request needs the local torch runner"
        self.validate_prompt(prompt_token_ids)
        request = Request(
            request_id, prompt_token_ids, params, arrival_time=metrics.arrived_ns / 1e9,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
        )
        for token_id in output_token_ids:
            request.append_output_token(token_id)
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        block_ids = self.scheduler.add_prefilled_request(request)
        if block_ids is None:
            return False
        self.executor.write_blocks(block_ids, kv)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        detok.update(list(output_token_ids))
        self.recorder.admit(metrics, request, admitted_ns or time.monotonic_ns())
        self._tracked[request_id] = _Tracked(
            request, None, detok, metrics, [] if params.logprobs is not None else None)
        return True

    def is_parked(self, request_id: str) -> bool:
        return request_id in self.scheduler.parked

    def parked_block_ids(self, request_id: str) -> list[int]:
        """The block table of a parked request (its K/V: prompt + outputs but the last token)."""
        assert request_id in self.scheduler.parked, f"{request_id} is not parked"
        return list(self.scheduler.kv_cache_manager.req_to_blocks[request_id])

    def release_parked(self, request_id: str) -> bool:
        """Free a parked request's blocks (its KV reached a decode worker, or its lease ended) and
        forget it without a record or an output. False if it is not parked here."""
        if request_id not in self.scheduler.parked:
            return False
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)
        self._tracked.pop(request_id, None)
        self.recorder.drop(request_id)
        return True

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort in any phase; blocks are freed now, the executor drops its state next step."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        now = time.monotonic_ns()
        outs = []
        for rid in request_ids:
            t = self._tracked.pop(rid, None)
            if t is not None:
                t.finish_reason = "abort"
                out = self._output(t, finished=True)
                self.recorder.finish(rid, "abort", len(out.outputs[0].token_ids), now)
                outs.append(out)
        self.refresh_gauges()  # an idle engine runs no iteration that would update them
        return outs

    def refresh_gauges(self) -> None:
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        self.metrics.set_gauges(sched.num_running, sched.num_waiting, pool.usage, pool.num_used_blocks)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        return EngineStats(sched.num_waiting, sched.num_running, len(sched.requests), pool.usage,
                           pool.num_used_blocks, self.recorder.stats())

    # -- the phase record's policy (PhaseRecorder) --------------------------------------------------
    @property
    def recording(self) -> bool:
        """Iteration records, modeled costs, Prometheus, kept records; off only to measure what
        recording costs (benchmarks/record_overhead.py)."""
        return self.recorder.enabled

    @recording.setter
    def recording(self, on: bool) -> None:
        self.recorder.enabled = on

    @property
    def keep_records(self) -> bool:
        return self.recorder.keep

    @property
    def finished_requests(self) -> list[RequestMetrics]:
        return self.recorder.requests

    @property
    def iterations(self) -> list[IterationRecord]:
        return self.recorder.iterations

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic_ns()
        plan = self.scheduler.schedule(t0 / 1e9)  # the clock of the requests' arrival_time
        t1 = time.monotonic_ns()
        result = self.executor.execute(plan)
        t2 = time.monotonic_ns()
        deltas = self.scheduler.update(plan, result)
        outputs = self._process(plan, deltas, t0, t2)
        t3 = time.monotonic_ns()
        predicted = None
        if self.budget_learner is not None and not plan.is_empty:  # learn, then plan the next with it
            predicted = self.budget_learner.observe(plan, (t3 - t0) / 1e9)
            self.scheduler.set_cost_coefficients(self.budget_learner.planning_coefficients)
        if self.recording:
            self._record_iteration(plan, result, t0, t1, t2, t3, predicted)
        self.last_plan = plan
        self._hand_over(outputs)
        return outputs

    def _process(self, plan: SchedulerOutput, deltas: list[RequestDelta], start_ns: int, end_ns: int
                 ) -> list[RequestOutput]:
        """Phase stamps (the recorder), detokenization and stop strings; the outputs of this step."""
        self.recorder.stamp_step(plan, deltas, start_ns, end_ns)
        outputs = []
        for d in deltas:
            t = self._tracked.get(d.request_id)
            if t is None:
                continue
            if t.logprobs is not None and d.logprobs is not None:
                t.logprobs.append(d.logprobs)
            t.new_token_ids = d.new_token_ids
            stop_str = t.detok.update(d.new_token_ids) if d.new_token_ids else None
            if stop_str is not None and d.finish_reason is None:
                self.scheduler.finish_requests([d.request_id], RequestStatus.FINISHED_STOPPED)
            if stop_str is not None:
                t.finish_reason, t.stop_reason = "stop", stop_str
            elif d.finish_reason is not None:
                t.finish_reason, t.stop_reason = d.finish_reason, d.stop_reason
            finished = t.finish_reason is not None
            if finished:
                del self._tracked[d.request_id]
            outputs.append(self._output(t, finished))
        return outputs

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """The outputs leave step() now: their tokens' sent stamps (offline) and the finished
        requests' ends, after the step's own bookkeeping (the iteration record, the metrics), so that
        a closed-loop caller's next request arrives microseconds after the end it waited for, not
        after that bookkeeping (workload/rerun.py reads releases from those gaps)."""
        sent_ns = time.monotonic_ns()
        for out in outputs:
            if self.stamp_sent:
                self.recorder.stamp_sent(out.metrics, sent_ns)
            if out.finished:
                c = out.outputs[0]
                self.recorder.finish(out.request_id, c.finish_reason, len(c.token_ids),
                                     sent_ns if self.stamp_sent else None)

    def mark_delivered(self, request_id: str, sent_ns: int) -> None:
        """The server wrote a finished request's last bytes at `sent_ns` (any thread may call)."""
        self.recorder.mark_delivered(request_id, sent_ns)

    def _record_iteration(self, plan: SchedulerOutput, result: StepResult, t0: int, t1: int, t2: int, t3: int,
                          predicted_s: float | None = None) -> None:
        """The iteration record (the recorder: kept and observed) with this plan's modeled cost and,
        under an adaptive budget, the prediction the policy planned with."""
        if plan.is_empty:
            return
        sched = self.scheduler
        self.recorder.iteration(
            plan, start_ns=t0, end_ns=t3, schedule_ns=t1 - t0, prepare_ns=result.prepare_ns,
            forward_ns=result.forward_ns, sample_ns=result.sample_ns, output_ns=t3 - t2,
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            modeled=self.cost_formulas.of_plan(plan), predicted_s=predicted_s, split_ns=result.split_ns)

    def _observe_iteration(self, rec: IterationRecord) -> None:
        """Prometheus of one iteration, and the prefix-cache counters since the last."""
        sched = self.scheduler
        stats = sched.prefix_cache_stats
        self.metrics.add_prefix_cache(stats.num_query_tokens - self._seen_query_tokens,
                                      stats.num_hit_tokens - self._seen_hit_tokens)
        self._seen_query_tokens, self._seen_hit_tokens = stats.num_query_tokens, stats.num_hit_tokens
        pool = sched.kv_cache_manager.block_pool
        self.metrics.observe_iteration(rec, rec.num_running, rec.num_waiting, pool.usage, pool.num_used_blocks)
        if self.budget_learner is not None:
            learner = self.budget_learner  # the fit, and the error factor the plan scales it by
            self.metrics.observe_budget(rec, {**learner.coefficients.to_json(), "error_factor": learner.error_factor})

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits at every position of one sequence (teacher forcing), outside the loop.

        Borrows free blocks from the pool for the duration of the call, so it must not run
        concurrently with step(). Used by tests and analysis.
        """
        self.validate_prompt(token_ids)
        assert isinstance(self.executor, ModelRunner), "score() needs the local torch runner"
        pool = self.scheduler.kv_cache_manager.block_pool
        blocks = pool.allocate(-(-len(token_ids) // self.cache_config.block_size))
        if blocks is None:
            raise InvalidRequestError("not enough free KV blocks to score this sequence now; retry when idle")
        try:
            return self.executor.score(token_ids, blocks)
        finally:
            pool.free(blocks)

    def _output(self, t: _Tracked, finished: bool) -> RequestOutput:
        r = t.request
        completion = CompletionOutput(
            index=0,
            # finished: flush text of a trailing partial character too (it ends in U+FFFD, as decode does)
            text=t.detok.get_next_output_text(finished=finished, delta=False),
            token_ids=list(r.output_token_ids),
            finish_reason=t.finish_reason,
            stop_reason=t.stop_reason,
            logprobs=list(t.logprobs) if t.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=r.request_id, prompt=t.prompt, prompt_token_ids=r.prompt_token_ids,
            outputs=[completion], finished=finished, metrics=t.metrics,
            num_cached_tokens=max(r.num_cached_tokens, 0),
        )

    # -- the run directory -----------------------------------------------------------------------
    def record_ceilings(self, ceilings: dict[str, Any] | None = None) -> dict[str, Any]:
        """This host's ceilings for this engine's model shapes, dtype and threads (engine/ceilings.py
        host_ceilings: cached per CPU, measured the first time, a few seconds), or take `ceilings`
        measured elsewhere; every run directory written after records them in config.json
        ("ceilings"), where `phaselab simulate calibrate` and `phaselab diagnose` find them."""
        self.ceilings = ceilings or host_ceilings(self.model_config, self.dtype, log=logger.info)
        return self.ceilings

    def run_config(self) -> dict[str, Any]:
        """config.json of a run directory (engine/run_config.py)."""
        return engine_run_config(self)

    def write_record(self, path: str) -> None:
        """Write the run directory (docs/run-directory.md): every finished request, every iteration."""
        write_run_dir(path, list(self.finished_requests), list(self.iterations), self.run_config(),
                      self.metrics.render())

    def shutdown(self) -> None:
        """Nothing to stop in-process (the ServingEngine surface; a disaggregated engine stops its workers)."""

    def tracked(self, request_id: str) -> _Tracked | None:
        return self._tracked.get(request_id)
