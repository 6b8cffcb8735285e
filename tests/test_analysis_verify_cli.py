"""`phaselab diagnose RUN --verify` picks the change it reruns: the highest-ranked finding whose change
the prediction supports (the rerun itself: tests/test_analysis_verify.py)."""

from __future__ import annotations

from types import SimpleNamespace


def test_verify_reruns_the_highest_ranked_suggested_change(monkeypatch, capsys, tmp_path):
    """`diagnose --verify` follows the first finding whose change the prediction supports: not a
    finding without a knob, nor a change the prediction advised against."""
    import argparse

    import phaselab.experiments.diagnose_verify as verify_module
    from phaselab.experiments.diagnose_verify import verify_top

    def finding(cause, flags=None, suggested=True):
        pred = SimpleNamespace(change=SimpleNamespace(flags=flags)) if flags else None
        return SimpleNamespace(cause=cause, prediction=pred, suggested=suggested)

    verified = []

    class _Verification:
        notes: list[str] = []
        runs: dict = {}

        def text(self):
            return "verified\n"

        def rows(self):
            return []

    def fake_verify(path, prediction, before_url=None, after_url=None):  # the rerun is test_analysis_verify.py's
        assert before_url is None and after_url is None
        verified.append(prediction.change.flags)
        return _Verification()

    monkeypatch.setattr(verify_module, "verify", fake_verify)
    ns = argparse.Namespace(run_dir=str(tmp_path), out=None, no_write=True, before_url=None, after_url=None)
    none = SimpleNamespace(findings=[finding("decode"), finding("stall", "--max-num-batched-tokens 1024", False)])
    assert verify_top(none, ns) == 2 and verified == []
    err = capsys.readouterr().err
    assert "skipping #1 decode: no engine knob" in err and "skipping #2 stall" in err and "not suggested" in err
    some = SimpleNamespace(findings=[finding("prefill"), finding("queue", "--max-num-seqs 8", False),
                                     finding("decode-kv", "--max-num-seqs 16"), finding("stall", "--policy chunked")])
    assert verify_top(some, ns) == 0 and verified == ["--max-num-seqs 16"]
    assert "verifying #3 decode-kv" in capsys.readouterr().err
