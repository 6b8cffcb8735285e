"""Shared fixtures. Thread settings first: OpenMP reads them when torch loads it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No spin: the suite runs servers, workers and itself at once on 2 cores, where spinning threads of
# one process take the cores from another's (cli.py); the servers it starts inherit this.
os.environ.setdefault("GOMP_SPINCOUNT", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests._model_helpers import bundled_gguf_path  # noqa: E402

_TORCH_THREADS = torch.get_num_threads()  # this process's default, before any test


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """An engine built in this process with num_threads sets torch's process-wide thread count
    (engine/engine.py); no test hands that setting to the next. Without this, the self-fidelity
    test measured "this host" at 1 thread after test_disagg's in-process workers (num_threads=1)
    in the full suite, and at 2 threads alone."""
    yield
    if torch.get_num_threads() != _TORCH_THREADS:
        torch.set_num_threads(_TORCH_THREADS)


@pytest.fixture(scope="session")
def bundled_path() -> str:
    return bundled_gguf_path()


@pytest.fixture(scope="session")
def hf_model(bundled_path):
    """Hugging Face transformers' own reading of the bundled GGUF, fp32: the reference."""
    from tests._model_helpers import load_hf_reference

    return load_hf_reference(bundled_path)


@pytest.fixture(scope="session")
def llm_fp32():
    from phaselab import LLM

    return LLM(dtype="float32", kv_cache_memory="1GiB", max_model_len=4096)


@pytest.fixture(scope="session")
def prompts(llm_fp32) -> list[list[int]]:
    from tests._model_helpers import make_prompts

    return make_prompts(llm_fp32.get_tokenizer())


LONG_TEST_S = 120.0
LONG_TEST_LINES = 4  # of a long test's own output, printed with its name
_config = []


def pytest_configure(config):
    _config.append(config)


def pytest_runtest_logreport(report):
    """Name every test that ran past LONG_TEST_S as it ends, with the serving dtype: CI stops at 90
    minutes, and a run cut off there prints no --durations table (on an AVX2-only EPYC the suite
    once ran past it serving bf16)."""
    terminal = _config[0].pluginmanager.get_plugin("terminalreporter") if _config else None
    if report.when == "call" and report.duration > LONG_TEST_S and terminal is not None:
        from tests._model_helpers import serving_dtype

        terminal.write_line(f"\n[long test] {report.nodeid}: {report.duration:.0f} s ({report.outcome}, "
                            f"serving {serving_dtype()})")
        # what it printed last (the attempts of a test that measures again before it fails): a
        # passing test's output is otherwise never shown, and a pass on its third attempt costs twice
        for line in [x for x in report.capstdout.splitlines() if x.strip()][-LONG_TEST_LINES:]:
            terminal.write_line(f"    {line[:300]}")
