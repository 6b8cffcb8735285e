"""One declaration per knob (issue 33): each scheduler and cache option is declared once, in
core/config.py (SchedulerConfig, CacheConfig), and every other dataclass that carries it (the
engine's EngineArgs, the simulator's RoleConfig and Deployment) declares its copy with
`knob(name)`; command-line flags come from those fields (cliargs.add_fields), not from hand-written
add_argument calls with their own default; and a default that several commands share is a named
constant, not a literal repeated. The truth is the source (an AST walk of phaselab/), so a new copy
with its own default fails here before it can drift (before this, max_num_seqs defaulted to 128 in
the engine and 256 in the simulator, with three help texts)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from phaselab.core.config import CacheConfig, SchedulerConfig, knob

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "phaselab"
DECLARED_IN = PACKAGE / "core" / "config.py"
# CacheConfig.num_blocks is resolved from --kv-cache-memory, not an option; the simulator's RoleConfig
# takes the count itself (None: from the GPU's memory), a different knob under the same name
NOT_OPTIONS = {"num_blocks"}
OPTIONS = {f.name for cls in (SchedulerConfig, CacheConfig) for f in dataclasses.fields(cls)} - NOT_OPTIONS
# hand-written flags named like an option that take something else: a list of values to try, or a
# required target (each with its reason)
LIST_FLAGS = {
    ("experiments/plan.py", "--max-num-seqs"): "seats per engine to try, a list",
    ("experiments/plan.py", "--slo-tbt-ms"): "the plan's required TBT target",
    ("experiments/plan.py", "--slo-ttft-ms"): "the plan's required TTFT target",
    ("experiments/compare_cli.py", "--slo-tbt-ms"): "compare's adaptive configurations, a list of targets",
}


# fields named like an option that hold something else, each with its reason
NOT_DEFAULTS = {
    ("core/outputs.py", "SchedulerOutput.block_size"): "0 = not known (a synthetic plan), a record's field",
    ("experiments/compare.py", "Plan.max_model_len"): "the value compare runs its engines with (its longest "
                                                      "request), a setting of one experiment",
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(PACKAGE.rglob("*.py"))]


def option_copies(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, class, field) of every class-level field named like an option that declares a default
    other than knob(...) (a field with no default, or None, holds a value decided elsewhere)."""
    out = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in OPTIONS
                    and stmt.value is not None
                    and not (isinstance(stmt.value, ast.Constant) and stmt.value.value is None)):
                v = stmt.value
                if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "knob"):
                    out.append((stmt.lineno, cls.name, stmt.target.id))
    return out


def option_flags(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, flag) of every add_argument("--<option>", ...) written by hand."""
    flags = {"--" + n.replace("_", "-") for n in OPTIONS}
    out = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument" and call.args:
            first = call.args[0]
            if isinstance(first, ast.Constant) and first.value in flags:
                out.append((call.lineno, first.value))
    return out


def option_fallbacks(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of `x.<option> or <number>`: a default decided again where the option is read (0, an
    option's "off", aside)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
            left, right = node.values
            if (isinstance(left, ast.Attribute) and left.attr in OPTIONS and isinstance(right, ast.Constant)
                    and isinstance(right.value, int | float) and not isinstance(right.value, bool) and right.value):
                out.append((node.lineno, f"{left.attr} or {right.value}"))
    return out


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def list_literals(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every comma-separated number list in a string (a default like "512,2048")."""
    doc = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in doc
            and re.fullmatch(r"\d+(\.\d+)?(,\d+(\.\d+)?)+", n.value)]


def test_each_option_is_declared_once():
    found = [f"{rel}:{line}: {cls}.{name}" for rel, tree in _modules() if PACKAGE / rel != DECLARED_IN
             for line, cls, name in option_copies(tree) if (rel, f"{cls}.{name}") not in NOT_DEFAULTS]
    assert not found, ("options declared again with their own default and help; declare them with "
                       "core.config.knob(name):\n" + "\n".join(found))


def test_option_flags_come_from_the_fields():
    found = [f"{rel}:{line}: {flag}" for rel, tree in _modules() for line, flag in option_flags(tree)
             if (rel, flag) not in LIST_FLAGS]
    assert not found, ("hand-written flags for options; generate them with cliargs.add_fields from the field "
                       "(its default and help):\n" + "\n".join(found))
    assert all(flag in (PACKAGE / rel).read_text(encoding="utf-8") for rel, flag in LIST_FLAGS), \
        "an exempted flag is gone: drop it from LIST_FLAGS"


def test_no_default_is_decided_again_where_an_option_is_read():
    found = [f"{rel}:{line}: {text}" for rel, tree in _modules() for line, text in option_fallbacks(tree)]
    assert not found, ("an option's default repeated at its use (`x.budget or 2048`); use the named constant "
                       "(core.config.CHUNKED_BUDGET_DEFAULT) or SchedulerConfig.resolve:\n" + "\n".join(found))


def test_shared_list_defaults_are_written_once():
    seen: dict[str, list[str]] = {}
    for rel, tree in _modules():
        for line, text in list_literals(tree):
            seen.setdefault(text, []).append(f"{rel}:{line}")
    repeated = {text: where for text, where in seen.items() if len(where) > 1}
    assert not repeated, f"the same default list written in several places; name it once: {repeated}"


def test_the_copies_are_the_declaration():
    """Behaviour, not just structure: every carrier's default and help of an option is core's (an
    option left unset says in its help what None means), and the engine and the simulator agree."""
    from phaselab.engine_args import EngineArgs
    from phaselab.sim.deployment import Deployment, RoleConfig

    core = {f.name: f for cls in (SchedulerConfig, CacheConfig) for f in dataclasses.fields(cls)}
    checked = 0
    for cls in (EngineArgs, RoleConfig, Deployment):
        for f in dataclasses.fields(cls):
            if f.name not in OPTIONS:
                continue
            checked += 1
            if f.default is None:  # unset: decided later (the budget by resolve, max_model_len by the cache)
                assert f.metadata["help"].startswith(core[f.name].metadata["help"] + " (default"), (cls, f.name)
            else:
                assert (f.default, f.metadata["help"]) == (core[f.name].default, core[f.name].metadata["help"]), \
                    (cls.__name__, f.name)
    assert checked >= 20
    assert EngineArgs().max_num_seqs == RoleConfig().max_num_seqs == SchedulerConfig().max_num_seqs


def test_the_checks_find_a_copy(tmp_path):
    """A test of the test: a dataclass re-declaring max_num_seqs, a hand-written --policy flag, a
    fallback `rc.max_num_batched_tokens or 2048` and a list default written twice are each found."""
    src = ("from dataclasses import dataclass, field\n"
           "@dataclass\nclass Role:\n    max_num_seqs: int = field(default=64)\n    policy: str = knob('policy')\n"
           "def add(p):\n    p.add_argument('--policy', default='chunked')\n    p.add_argument('--tps', default='1,2')\n"
           "def budget(rc):\n    return rc.max_num_batched_tokens or 2048\n"
           "X = '1,2'\n")
    tree = ast.parse(src)
    assert option_copies(tree) == [(4, "Role", "max_num_seqs")]
    assert option_flags(tree) == [(7, "--policy")]
    assert option_fallbacks(tree) == [(10, "max_num_batched_tokens or 2048")]
    assert sorted(list_literals(tree)) == [(8, "1,2"), (11, "1,2")]


def test_knob_refuses_an_unknown_name_and_an_undocumented_unset():
    import pytest

    with pytest.raises(KeyError):
        knob("max_num_sequences")
    with pytest.raises(ValueError):
        knob("max_num_seqs", unset=True)  # None would mean nothing the help says
