"""The OpenMP settings the CLI fixes before torch loads (cli.py's `auto`): an engine alone on the
cores (`generate`, colocated) gets PASSIVE with a bounded spin; `serve` and a disaggregated
deployment's processes get none (other busy threads share the cores: benchmarks/wait_policy.py
measured a batch-1 step of two spinning processes at ~10x that of two PASSIVE ones, and a spinning
server fewer tokens/s at concurrency 1 and 8); a spin count the user set is kept."""

from __future__ import annotations

import argparse

import pytest

from phaselab.cli import SPIN_COUNT, _set_threads
from phaselab.disagg.process import worker_env


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def settings(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"omp_wait_policy": "auto", "num_threads": 0, "mode": "colocated", **kw})


def test_auto_spins_briefly_for_an_engine_alone(env: pytest.MonkeyPatch) -> None:
    import os

    _set_threads(settings(), alone=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT


def test_auto_does_not_spin_beside_a_server_loop(env: pytest.MonkeyPatch) -> None:
    import os

    _set_threads(settings())  # serve: the event loop and the clients share the cores
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ


def test_auto_keeps_a_spin_count_the_user_set(env: pytest.MonkeyPatch) -> None:
    import os

    env.setenv("GOMP_SPINCOUNT", "0")
    _set_threads(settings(num_threads=2), alone=True)
    assert os.environ["GOMP_SPINCOUNT"] == "0" and os.environ["OMP_NUM_THREADS"] == "2"


def test_disaggregated_processes_do_not_spin(env: pytest.MonkeyPatch) -> None:
    import os

    _set_threads(settings(mode="disagg"), alone=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ
    w = worker_env(1, "decode-0")  # GOMP_SPINCOUNT overrides the policy: the workers' must be 0
    assert w["OMP_WAIT_POLICY"] == "PASSIVE" and w["GOMP_SPINCOUNT"] == "0"


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE"])
def test_an_explicit_policy_sets_no_spin_count(env: pytest.MonkeyPatch, policy: str) -> None:
    import os

    _set_threads(settings(omp_wait_policy=policy), alone=True)
    assert os.environ["OMP_WAIT_POLICY"] == policy and "GOMP_SPINCOUNT" not in os.environ
