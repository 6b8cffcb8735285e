"""The engine's surface: the pure sizing step (resolve), the ServingEngine protocol both engines
implement, the one prompt check, and the package layering they allow."""

from __future__ import annotations

import inspect
import pathlib
import subprocess
import sys

import pytest

from phaselab.engine_args import EngineArgs
from phaselab.core.prompt import validate_prompt
from phaselab.engine.resolve import resolve
from phaselab.errors import ConfigError, InvalidRequestError

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _Model:
    """The two facts sizing reads of a model: 2 layers x 2 KV heads x head_dim 16, 256 positions."""

    max_position_embeddings = 256

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * 2 * 2 * 16 * dtype_bytes  # K and V, layers, KV heads, head_dim


def test_resolve_sizes_the_cache_and_the_scheduler_without_torch():
    code = "import sys, phaselab.engine.resolve; assert 'torch' not in sys.modules, 'resolve imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    # 1 MiB of fp32 KV: 512 bytes per token x 16 tokens per block = 8 KiB per block -> 128 blocks
    r = resolve(EngineArgs(kv_cache_memory="1MiB", block_size=16), _Model(), 4)
    assert (r.block_bytes, r.cache.num_blocks) == (8192, 128)
    assert r.max_model_len == 256  # the model's context (the cache holds 2048 tokens)
    assert r.scheduler.max_num_batched_tokens == 2048  # chunked's default budget
    r = resolve(EngineArgs(kv_cache_memory="32KiB", block_size=16, policy="prefill-first"), _Model(), 4)
    assert (r.cache.num_blocks, r.max_model_len) == (4, 64)  # capped by the cache: 4 blocks x 16
    assert r.scheduler.max_num_batched_tokens == 64  # prefill-first: a whole prompt per iteration
    with pytest.raises(ConfigError, match="raise --kv-cache-memory"):
        resolve(EngineArgs(kv_cache_memory="32KiB", max_model_len=200), _Model(), 4)
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        resolve(EngineArgs(kv_cache_memory="1MiB", max_model_len=300), _Model(), 4)
    with pytest.raises(ConfigError, match="holds no KV block"):
        resolve(EngineArgs(kv_cache_memory="1KiB"), _Model(), 4)


def test_one_prompt_check():
    validate_prompt([1, 2, 3], 10, 4)
    for ids, vocab, limit, why in (([], 10, 4, "empty"), ([1, 10], 10, 4, "outside the vocabulary"),
                                   ([1, 2, 3, 4], 10, 4, "max_model_len is 4")):
        with pytest.raises(InvalidRequestError, match=why):
            validate_prompt(ids, vocab, limit)


def test_both_engines_implement_the_serving_engine_protocol():
    from phaselab.disagg.router import DisaggEngine
    from phaselab.engine.engine import LLMEngine
    from phaselab.serving_engine import ServingEngine

    methods = [n for n, v in vars(ServingEngine).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"add_request", "step", "abort_request", "has_unfinished_requests", "mark_delivered", "stats",
            "run_config", "write_record", "shutdown"} <= set(methods)
    for cls in (LLMEngine, DisaggEngine):
        for name in methods:
            assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        params = inspect.signature(cls.add_request).parameters
        assert {"arrived_ns", "tokenized_ns", "queued_ns", "prompt_text"} <= set(params), cls.__name__
        for prop in ("finished_requests", "iterations"):
            assert isinstance(inspect.getattr_static(cls, prop), property), (cls.__name__, prop)


def test_the_engine_package_does_not_import_disagg_and_fronts_do_not_reach_into_schedulers():
    engine_src = "\n".join(p.read_text() for p in (ROOT / "phaselab" / "engine").rglob("*.py"))
    assert "phaselab.disagg" not in engine_src
    for p in (ROOT / "phaselab" / "server").rglob("*.py"):
        assert ".scheduler" not in p.read_text(), p
    for p in [*(ROOT / "phaselab").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        text = p.read_text()
        assert ".tracked(" not in text or "metrics." not in text.split(".tracked(", 1)[1].split("\n", 1)[0], p
