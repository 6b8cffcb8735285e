"""Offline API: `LLM(...).generate(prompts, SamplingParams(...))` and `.chat(messages, ...)`."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from phaselab.engine_args import EngineArgs
from phaselab.core.sampling_params import SamplingParams
from phaselab.engine.engine import LLMEngine
from phaselab.engine.request_output import RequestOutput
from phaselab.errors import InvalidRequestError

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, list)):
            raise InvalidRequestError(f"prompt {i} is a {type(p).__name__}; give a string or a list of token ids")
    return prompts  # type: ignore[return-value]


class LLM:
    """An engine plus a run-to-completion loop.

    >>> llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    >>> out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].text
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", kv_cache_memory: str | int = "2GiB",
                 **engine_options: Any) -> None:
        # the one factory above engine/ and disagg/ (mode="disagg": prefill/decode pools on Ray)
        from phaselab.serving_engine import make_engine

        disagg_config = engine_options.pop("disagg_config", None)
        self.engine: Any = make_engine(
            EngineArgs(model=model, dtype=dtype, kv_cache_memory=kv_cache_memory, **engine_options),
            disagg_config=disagg_config)

    def shutdown(self) -> None:
        """Stop the workers of a disaggregated engine (nothing to do for a colocated one)."""
        self.engine.shutdown()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built from an already loaded checkpoint)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt is tokenized and validated before any runs, so one bad prompt raises
        InvalidRequestError (naming its index) without starting the others.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"{len(params_list)} SamplingParams for {len(prompt_list)} prompts; give one, or one per prompt"
                )
        eng = self.engine
        token_lists = []
        for i, p in enumerate(prompt_list):
            ids = eng.tokenize(p)
            try:
                eng.validate_prompt(ids)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
            token_lists.append(ids)
        # n > 1 fans out into n requests; a seeded request's k-th sample uses seed + k
        children: list[list[str]] = []
        for p, ids, params in zip(prompt_list, token_lists, params_list):
            ids_of_prompt = []
            for k in range(params.n):
                child = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + k)
                rid = eng.add_request(ids, child, prompt_text=p if isinstance(p, str) else None)
                ids_of_prompt.append(rid)
            children.append(ids_of_prompt)
        finished: dict[str, RequestOutput] = {}
        total = sum(len(c) for c in children)
        progress = _Progress(total) if use_tqdm else None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
                    if progress:
                        progress.update(len(finished))
        if progress:
            progress.close()
        results = []
        for rids in children:
            first = finished[rids[0]]
            outs = []
            for k, rid in enumerate(rids):
                c = finished[rid].outputs[0]
                c.index = k
                outs.append(c)
            first.outputs = outs
            results.append(first)
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[Prompt] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


class _Progress:
    """A one-line progress display on stderr (no dependency)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def update(self, done: int) -> None:
        print(f"\rrequests finished: {done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)
