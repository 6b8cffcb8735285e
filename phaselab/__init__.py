"""phaselab: an LLM serving engine that schedules, records and explains prefill and decode.

`LLM` and the output types load torch, so they are imported lazily: `import phaselab.core...`
(the pure-Python scheduler the simulator reuses) must not pull torch in.
"""

from typing import Any

from phaselab.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from phaselab.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from phaselab.engine import request_output as outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'phaselab' has no attribute {name!r}")
