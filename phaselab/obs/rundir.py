"""The run directory: one run's phase record on disk (format: docs/run-directory.md).

    DIR/config.json       {"format": "phaselab-run", "version": 1, "created": ..., <caller's config>}
    DIR/requests.jsonl    one {"record": "request", <RequestMetrics fields>, <derived *_s>} per line
    DIR/iterations.jsonl  one {"record": "iteration", <IterationRecord fields>, "modeled_*": ...} per line
    DIR/trace.json        build_trace(): open in ui.perfetto.dev
    DIR/metrics.prom      the Prometheus text snapshot, when given

The version lives in config.json only; every JSONL line says which record it is. Reading
rebuilds the dataclasses from their own fields (derived keys are recomputed, not read back), so
`read_run_dir(write_run_dir(x)) == x` field for field. `analysis/` reads runs through this module.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from os import PathLike
from pathlib import Path
from typing import Any

from phaselab.core.timing import IterationRecord, RequestMetrics
from phaselab.cost.formulas import ModeledCost
from phaselab.errors import PhaselabError
from phaselab.obs.perfetto import build_trace, write_trace

RUN_FORMAT = "phaselab-run"
RUN_VERSION = 1
MODELED_PREFIX = "modeled_"


class RunDirError(PhaselabError, ValueError):
    """The directory is not a phaselab run directory, or one this version cannot read."""


@dataclass
class RunData:
    requests: list[RequestMetrics]
    iterations: list[IterationRecord]
    config: dict[str, Any]  # config.json as written, format/version/created included
    metrics_text: bytes | None = None


# -- records <-> JSON objects ------------------------------------------------------------------------
def request_to_json(m: RequestMetrics) -> dict[str, Any]:
    """Every field of the record, then the derived durations in seconds (for readers without phaselab)."""
    return {"record": "request", **dataclasses.asdict(m), **_request_derived(m)}


def _request_derived(m: RequestMetrics) -> dict[str, Any]:
    return {
        "tokenize_s": m.tokenize_s,
        "admission_s": m.admission_s,
        "queue_s": m.queue_s,
        "prefill_compute_s": m.prefill_compute_s if m.prefill_chunks else None,
        "prefill_span_s": m.prefill_span_s,
        "prefill_wait_s": m.prefill_wait_s,
        "ttft_s": m.ttft_s,
        "ttft_components_s": m.ttft_components(),
        "itl_s": m.itl_s,
        "tpot_s": m.tpot_s,
        "e2e_s": m.e2e_s,
        "decode_s": m.decode_s,
        "transfer_queue_s": m.transfer_queue_s,
        "transfer_s": m.transfer_s,
        "decode_admission_wait_s": m.decode_admission_wait_s,
        "delivery_s": m.delivery_s,
    }


def iteration_to_json(rec: IterationRecord) -> dict[str, Any]:
    """The record with its modeled cost flattened into `modeled_*` keys, so no reader mistakes a
    modeled figure for a measured one."""
    d = dataclasses.asdict(rec)
    modeled = d.pop("modeled")
    return {
        "record": "iteration",
        **d,
        "duration_s": rec.duration_s,
        "other_ns": rec.other_ns,  # derived: the step outside the measured split (None without one)
        **{MODELED_PREFIX + k: v for k, v in modeled.items()},
        "modeled_total_bytes": rec.modeled.total_bytes,
        "modeled_flops": rec.modeled.flops,
    }


def request_from_json(d: dict[str, Any]) -> RequestMetrics:
    return _from_json(RequestMetrics, d)


def iteration_from_json(d: dict[str, Any]) -> IterationRecord:
    modeled_fields = {f.name for f in dataclasses.fields(ModeledCost)}
    modeled = {k[len(MODELED_PREFIX):]: v for k, v in d.items()
               if k.startswith(MODELED_PREFIX) and k[len(MODELED_PREFIX):] in modeled_fields}
    return _from_json(IterationRecord, {**d, "modeled": modeled})


_T = typing.TypeVar("_T")


def _from_json(cls: type[_T], d: dict[str, Any]) -> _T:
    """Rebuild a dataclass from its own fields (typed through its annotations, nested dataclasses
    and lists of them included); unknown keys (derived values, "record") are ignored, missing
    ones keep their defaults, so older files stay readable as fields are added."""
    hints = _type_hints(cls)
    present = [f.name for f in dataclasses.fields(cls) if f.name in d]  # type: ignore[arg-type]
    return cls(**{name: _convert(hints[name], d[name]) for name in present})


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations, once per class: get_type_hints re-evaluates them on every call, which
    dominated reading a run of tens of thousands of iterations."""
    return typing.get_type_hints(cls)


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return _from_json(hint, value)  # type: ignore[arg-type]
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value]
    return value


# -- the directory ---------------------------------------------------------------------------------------
def write_run_dir(
    path: str | PathLike[str],
    requests: list[RequestMetrics],
    iterations: list[IterationRecord],
    config: dict[str, Any],
    metrics_text: bytes | None = None,
    process_names: dict[str, str] | None = None,
) -> None:
    """Write (or overwrite) the run directory at `path`, creating it if needed."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / "config.json", run_config(config))
    _write_jsonl(root / "requests.jsonl", (request_to_json(m) for m in requests))
    _write_jsonl(root / "iterations.jsonl", (iteration_to_json(rec) for rec in iterations))
    write_trace(root / "trace.json", build_trace(requests, iterations, process_names))
    if metrics_text is not None:
        (root / "metrics.prom").write_bytes(metrics_text)


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    """The caller's config under the format header. `created` is the one wall-clock read of obs/
    (a file's creation date); a caller that wants a reproducible file passes its own."""
    created = config.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {"format": RUN_FORMAT, "version": RUN_VERSION, **config, "created": created}


def engine_config(config: dict[str, Any], role: str | None = None) -> dict[str, Any]:
    """The engine part of a run's config.json (model, dtype, linear, scheduler, cache, machine): the
    config itself for one engine; for a disaggregated run (the router's config), the recorded
    config of its first worker of `role` (any role when None: every worker runs one model and
    dtype). Raises RunDirError when a disaggregated run recorded no worker of that role."""
    if config.get("mode") != "disagg":
        return config
    for name, w in sorted((config.get("workers") or {}).items()):
        if (role is None or w.get("role") == role) and w.get("engine"):
            return dict(w["engine"])
    raise RunDirError(f"this disaggregated run recorded no {role or ''} worker's engine config (config.json's "
                      "'workers'); record it again with a phaselab that writes them")


def read_run_dir(path: str | PathLike[str]) -> RunData:
    root = Path(path)
    config = _read_config(root)
    prom = root / "metrics.prom"
    return RunData(
        requests=[request_from_json(d) for d in _read_jsonl(root / "requests.jsonl", "request")],
        iterations=[iteration_from_json(d) for d in _read_jsonl(root / "iterations.jsonl", "iteration")],
        config=config,
        metrics_text=prom.read_bytes() if prom.exists() else None,
    )


def _read_config(root: Path) -> dict[str, Any]:
    file = root / "config.json"
    if not file.is_file():
        raise RunDirError(f"{root} is not a run directory: {file.name} is missing (write one with --record DIR)")
    config = json.loads(file.read_text(encoding="utf-8"))
    if config.get("format") != RUN_FORMAT:
        raise RunDirError(f"{file} is not a phaselab run (format {config.get('format')!r}, want {RUN_FORMAT!r})")
    if not isinstance(config.get("version"), int) or config["version"] > RUN_VERSION:
        raise RunDirError(
            f"{file} has format version {config.get('version')!r}; this phaselab reads up to {RUN_VERSION}: upgrade it"
        )
    return dict(config)


def _write_json(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def _write_jsonl(file: Path, objs: Iterator[dict[str, Any]]) -> None:
    with open(file, "w", encoding="utf-8") as f:
        for obj in objs:
            f.write(json.dumps(obj, separators=(",", ":"), default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    """Configs carry dataclasses, paths and enums; JSON gets their plain form."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    return str(obj)


def _read_jsonl(file: Path, record: str) -> list[dict[str, Any]]:
    if not file.is_file():
        raise RunDirError(f"{file} is missing; the run directory is incomplete")
    rows = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunDirError(f"{file}:{lineno}: not JSON ({e.msg}); the file is truncated or corrupted") from e
            if d.get("record") != record:
                raise RunDirError(f"{file}:{lineno}: record {d.get('record')!r}, want {record!r}")
            rows.append(d)
    return rows
