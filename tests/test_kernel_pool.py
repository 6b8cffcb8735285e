"""The kernels' thread pool (`phaselab/model/kernels/pool.c`): same results as OpenMP's team, work
really shared, safe from two threads at once and after fork, and asleep when idle.

The pool only decides which thread runs which chunk of output rows (qlinear) or (request, head)
items (paged attention); every chunk is computed by the same code in the same order either way, so
the truth here is the kernel run on OpenMP's team (the library's pool pointer set to NULL), and
results must be bit-identical, not close. The kernels themselves are checked against float64
references in tests/test_qlinear.py and tests/test_kernels.py, which run on the pool by default.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from phaselab.model import kernels
from phaselab.model.kernels import library, qlinear

pytestmark = pytest.mark.skipif(
    not qlinear.available() or kernels.pool_address() is None,
    reason=f"pool or kernel unavailable: {library.pool_reason() or qlinear.unavailable_reason()}",
)


@contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextmanager
def openmp_team():
    """The kernels on OpenMP's team, as with PHASELAB_POOL=0."""
    setters = [qlinear._load().qlinear_set_pool]
    if kernels.available():
        setters.append(kernels._load().paged_decode_set_pool)
    for set_pool in setters:
        set_pool(None)
    try:
        yield
    finally:
        for set_pool in setters:
            set_pool(kernels.pool_address())


def _q41(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q4_1 blocks with sane fp16 scales (the kernel's output order is what is tested)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    blocks = rng.integers(0, 256, size=(n, nb, 20), dtype=np.uint8)
    blocks[:, :, 0:2] = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    blocks[:, :, 2:4] = rng.uniform(-0.1, 0.0, (n, nb)).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(blocks.reshape(n, -1).copy())


def _linear(w: torch.Tensor, n: int, k: int, x: torch.Tensor, fmt: str = "Q4_1") -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    scratch = torch.empty(max(1, qlinear.scratch_floats(fmt, x.shape[0], k, x.dtype)), dtype=torch.float32)
    return qlinear.linear(fmt, w, n, k, x, out, scratch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 64])
def test_qlinear_pool_equals_openmp_team(m: int, dtype: torch.dtype) -> None:
    n, k = 963, 576  # odd row count: the chunk edges and the N % 4 rows after the four-row passes
    w = _q41(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    with threads(2):
        before = kernels.pool_stats()
        pooled = _linear(w, n, k, x)
        after = kernels.pool_stats()
        with openmp_team():
            team = _linear(w, n, k, x)
    assert torch.equal(pooled, team)
    assert after["calls_pooled"] > before["calls_pooled"], "the call did not go through the pool"


def test_workers_take_chunks() -> None:
    """With two threads, the worker runs some of the chunks (the caller does not do them all)."""
    n, k = 49152, 576  # the LM head's shape: ~1 ms of work per call, 16 chunks
    w = _q41(n, k, seed=1)
    x = torch.randn(1, k)
    with threads(2):
        before = kernels.pool_stats()
        for _ in range(20):
            _linear(w, n, k, x)
        after = kernels.pool_stats()
    assert after["workers"] >= 1
    assert after["chunks_by_workers"] > before["chunks_by_workers"]


def test_one_thread_runs_inline() -> None:
    n, k = 576, 576
    w = _q41(n, k, seed=2)
    x = torch.randn(1, k)
    with threads(2):
        ref = _linear(w, n, k, x)
    with threads(1):
        before = kernels.pool_stats()
        out = _linear(w, n, k, x)
        after = kernels.pool_stats()
    assert torch.equal(out, ref)
    assert after["calls_inline"] == before["calls_inline"] + 1
    assert after["chunks_by_workers"] == before["chunks_by_workers"]


def test_two_callers_at_once() -> None:
    """Two Python threads calling the kernel concurrently (ctypes releases the GIL): one holds the
    pool, the other runs its chunks inline; every result equals its reference."""
    n, k = 960, 576
    cases = []
    for i in range(4):
        w = _q41(n, k, seed=10 + i)
        x = torch.randn(1 + i, k, generator=torch.Generator().manual_seed(i))
        with openmp_team():
            cases.append((w, x, _linear(w, n, k, x)))
    errors: list[str] = []

    def hammer(idx: int) -> None:
        for it in range(200):
            w, x, ref = cases[(idx + it) % len(cases)]
            if not torch.equal(_linear(w, n, k, x), ref):
                errors.append(f"thread {idx} iteration {it}")

    with threads(2):
        before = kernels.pool_stats()
        ts = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        after = kernels.pool_stats()
    assert not any(t.is_alive() for t in ts), "a caller hung"
    assert not errors, errors[:5]
    assert after["calls_pooled"] + after["calls_inline"] - before["calls_pooled"] - before["calls_inline"] == 400


def test_paged_decode_pool_equals_openmp_team() -> None:
    if not kernels.available():
        pytest.skip(f"paged decode kernel unavailable: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    B, H, KVH, D, BS, blocks = 5, 9, 3, 64, 16, 64
    k_cache = torch.randn(blocks, BS, KVH, D, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, BS, KVH, D, generator=g).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=g)[: B * 8].reshape(B, 8).contiguous()
    lens = torch.tensor([1, 17, 128, 77, 40], dtype=torch.int64)
    q = torch.randn(B, H, D, generator=g)
    for b in (1, B):  # one request: an item per KV head; five: per request when threads allow
        with threads(2):
            pooled = kernels.paged_decode(q[:b].contiguous(), k_cache, v_cache, tables[:b].contiguous(), lens[:b], 0.125)
            with openmp_team():
                team = kernels.paged_decode(q[:b].contiguous(), k_cache, v_cache, tables[:b].contiguous(), lens[:b],
                                            0.125)
        assert torch.equal(pooled, team)


def test_idle_workers_sleep() -> None:
    """After a call the workers spin for PHASELAB_POOL_SPIN_US, then sleep: an idle engine holds no
    core. Polled until they are all asleep (no time limit asserted beyond the test's patience)."""
    n, k = 960, 576
    w = _q41(n, k, seed=3)
    with threads(2):
        _linear(w, n, k, torch.randn(1, k))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = kernels.pool_stats()
        if s["workers"] and s["sleeping"] == s["workers"]:
            break
        time.sleep(0.01)
    s = kernels.pool_stats()
    assert s["workers"] >= 1 and s["sleeping"] == s["workers"], s


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_forked_child_starts_its_own_workers() -> None:
    """The parent's worker threads do not exist in a forked child: it must start its own (or it
    would wait forever for chunks nobody claims). Only the kernel runs in the child (no torch op:
    OpenMP itself is not fork-safe)."""
    n, k = 49152, 576
    w = _q41(n, k, seed=4)
    x = torch.randn(1, k)
    out = torch.empty(1, n)
    scratch = torch.empty(k)
    with threads(2):
        ref = _linear(w, n, k, x).clone()
        pid = os.fork()  # noqa: the child only runs the kernel and numpy, then _exit
        if pid == 0:  # child
            code = 1
            try:
                start = kernels.pool_stats()
                for _ in range(5):
                    qlinear.linear("Q4_1", w, n, k, x, out, scratch)
                s = kernels.pool_stats()
                same = out.numpy().tobytes() == ref.numpy().tobytes()  # numpy: no OpenMP in the child
                code = 0 if same and s["workers"] >= 1 and s["chunks_by_workers"] > start["chunks_by_workers"] else 3
            finally:
                os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the kernel")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
