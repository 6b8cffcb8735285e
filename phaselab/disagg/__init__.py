"""Disaggregated serving: prefill and decode worker pools on Ray, the KV connector that moves a
request's blocks between them, and the router that places requests and streams their tokens.
See docs/disaggregation.md."""

from phaselab.disagg.disagg_config import DisaggConfig
from phaselab.disagg.connector import (
    KVLayout,
    KVLayoutMismatchError,
    KVUnavailableError,
)

__all__ = ["DisaggConfig", "DisaggEngine", "KVLayout", "KVLayoutMismatchError", "KVUnavailableError"]


def __getattr__(name: str):  # the router imports Ray; load it only when asked for
    if name == "DisaggEngine":
        from phaselab.disagg.router import DisaggEngine

        return DisaggEngine
    raise AttributeError(name)
