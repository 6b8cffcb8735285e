"""Command-line flags generated from config dataclasses: one source per knob.

Every flag of the engine (EngineArgs) and of the simulator's deployment (Deployment, RoleConfig)
comes from its dataclass field: the type from the annotation, the default from the field, the help
text and the choices from the field's metadata. A field's metadata may say:

    help     the help text (the default is appended)
    choices  the allowed values
    flag     the flag's name when it is not --<field-name> (e.g. "--replicas" for num_replicas)
    type     the parser of the flag's text when the annotation's type is not it (a byte size, JSON)
    metavar  the value's name in the help
    cli      False: no flag for this field
    shown_default  False: the help already says what the default means (no "(default: None)")

bool fields become --flag / --no-flag (argparse.BooleanOptionalAction). Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any


def _scalar_type(tp: Any) -> Any:
    """int for `int | None`, str for `str | int` (parsed later, e.g. a byte size), the type itself otherwise."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else str
    return tp


def flag_of(f: dataclasses.Field[Any], rename: Callable[[str], str] | None = None) -> str:
    name = rename(f.name) if rename else f.name
    return str(f.metadata.get("flag") or "--" + name.replace("_", "-"))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_fields(group: Any, cls: type, names: Iterable[str] | None = None, *, dest_suffix: str = "",
               flag_suffix: str = "", help_suffix: str = "", defaults: dict[str, Any] | None = None,
               dest_prefix: str = "", rename: Callable[[str], str] | None = None) -> list[str]:
    """Add a flag per field of dataclass `cls` (those in `names`, in that order; default: every field
    whose metadata does not say cli=False) to `group`. `flag_suffix` / `dest_suffix` let one field
    serve several roles (--tp, --tp-prefill -> tp, tp_prefill); `dest_prefix` keeps a group's dests
    apart (disagg_...); `rename` maps a field's name to its flag's (the "_s" of seconds dropped);
    `defaults` are values known only at run time (an environment variable). Returns the dests, in order."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    wanted = list(names) if names is not None else [n for n, f in by_name.items() if f.metadata.get("cli", True)]
    dests = []
    for name in wanted:
        f = by_name[name]
        default = (defaults or {}).get(name, _default(f))
        if default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{name} has no default; give it one in `defaults`")
        tp = _scalar_type(hints[name])
        dest = dest_prefix + name + dest_suffix
        text = str(f.metadata.get("help", "")) + help_suffix
        if f.metadata.get("shown_default", True):  # False: the help says what the default (None) means
            text = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        kw: dict[str, Any] = dict(dest=dest, default=default, help=text)
        flag = flag_of(f, rename) + flag_suffix
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            if "choices" in f.metadata:
                kw["choices"] = list(f.metadata["choices"])
            elif "metavar" in f.metadata:
                kw["metavar"] = f.metadata["metavar"]
            elif f.metadata.get("flag"):
                kw["metavar"] = flag.lstrip("-").upper().replace("-", "_")
            parse = f.metadata.get("type") or (tp if tp in (int, float) else str)
            group.add_argument(flag, type=parse, **kw)
        dests.append(dest)
    return dests


def field_values(ns: argparse.Namespace, cls: type, names: Iterable[str] | None = None,
                 dest_suffix: str = "", dest_prefix: str = "") -> dict[str, Any]:
    """{field name: the parsed value} of the fields add_fields added (same names, dest_prefix and dest_suffix)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    wanted = list(names) if names is not None else [n for n, f in fields.items() if f.metadata.get("cli", True)]
    return {n: getattr(ns, dest_prefix + n + dest_suffix) for n in wanted}
