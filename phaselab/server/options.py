"""The HTTP layer's options (engine options are EngineArgs): one declaration each, with its default
and help; `phaselab serve` makes a flag of each field (cliargs.add_fields). No I/O, nothing heavy:
the command line is built before fastapi loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from phaselab import envs
from phaselab.engine_args import parse_bytes

BUNDLED_MODEL_NAME = "smollm2-135m"


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    model_name: str = field(default=BUNDLED_MODEL_NAME, metadata={
        "flag": "--served-model-name", "shown_default": False,
        "help": "the model name clients send (default: smollm2-135m for the bundled model, else the model "
                "file's stem or directory's name)"})
    api_key: str | None = field(default=None, metadata={
        "shown_default": False, "help": "require 'Authorization: Bearer KEY' on every route but /health (default: "
                                        f"${envs.API_KEY.name}, else none)"})
    max_request_bytes: int = field(default=1 << 20, metadata={
        "type": parse_bytes, "metavar": "BYTES", "help": "largest request body, e.g. 1MiB; larger ones get 413"})
    max_queued_requests: int = field(default=256, metadata={
        "help": "answer 503 + Retry-After while this many requests wait for admission"})
    drain_timeout_s: float = field(default=30.0, metadata={
        "flag": "--drain-timeout", "metavar": "SECONDS",
        "help": "on SIGTERM/SIGINT, seconds to let running requests finish before aborting them"})
    record_dir: str | None = field(default=None, metadata={
        "flag": "--record", "metavar": "DIR", "shown_default": False,
        "help": "write the run directory to DIR on shutdown, on POST /record/flush and on SIGUSR1"})
    retry_after_s: int = field(default=1, metadata={"cli": False, "help": "Retry-After of a 503, seconds"})
