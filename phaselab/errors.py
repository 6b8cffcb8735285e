"""Exception types raised at phaselab's edges.

Every error a user can cause (a wrong path, a broken file, an unsupported model, a bad request)
raises one of these with a message that says what to do next. Inside the engine, broken
invariants are plain ``assert``s: they are bugs, not user errors.
"""


class PhaselabError(Exception):
    """Base class of every error phaselab raises on purpose."""


class ModelNotFoundError(PhaselabError, FileNotFoundError):
    """The model path does not exist or holds no loadable checkpoint."""


class ModelFormatError(PhaselabError, ValueError):
    """The checkpoint is corrupted, truncated, or a tensor is missing or mis-shaped."""


class UnsupportedModelError(PhaselabError, ValueError):
    """The architecture, quantization type or tokenizer kind is not implemented."""


class InvalidRequestError(PhaselabError, ValueError):
    """A request's prompt or sampling parameters are invalid (e.g. longer than max_model_len)."""


class ConfigError(PhaselabError, ValueError):
    """Engine options are inconsistent (e.g. a KV cache too small for max_model_len)."""
