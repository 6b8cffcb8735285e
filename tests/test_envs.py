"""phaselab/envs.py declares every PHASELAB_* environment variable once: no other module spells a
PHASELAB_ name in a string (an AST walk of the source, docstrings aside), and every name the
package, README.md and docs/ mention is declared there."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from phaselab import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "phaselab"
NAME = re.compile(r"PHASELAB_[A-Z0-9_]+")
# PHASELAB_ tokens that are not environment variables
NOT_VARIABLES = {
    "PHASELAB_SIMD_H": "simd.h's include guard, a C macro",
}


def spelled_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every PHASELAB_ name inside a string constant of `source` (f-strings' literal
    parts included), except in module, class and function docstrings."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return sorted((node.lineno, name) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  for name in NAME.findall(node.value))


def test_no_module_but_envs_spells_a_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path == PACKAGE / "envs.py":
            continue
        found += [f"{rel}:{line}: {name}" for line, name in spelled_names(path.read_text(encoding="utf-8"))]
    assert not found, ("read PHASELAB_* variables through phaselab/envs.py (envs.X.get(), .off(); envs.X.name "
                       "where a message or a child's environment names one):\n" + "\n".join(found))


def test_the_check_finds_a_spelled_name():
    source = ('"""Module docstring: PHASELAB_DOC is prose."""\n'
              "import os\n"
              "def f():\n"
              '    """PHASELAB_FUNC_DOC, prose too."""\n'
              '    x = os.environ.get("PHASELAB_FOO")  # PHASELAB_COMMENT\n'
              '    return f"set PHASELAB_BAR={x}"\n'
              "class C:\n"
              '    """PHASELAB_CLASS_DOC"""\n')
    assert spelled_names(source) == [(5, "PHASELAB_FOO"), (6, "PHASELAB_BAR")]
    assert spelled_names('"""Only PHASELAB_FOO in the docstring."""\nx = 1\n') == []


def _mentioned() -> dict[str, str]:
    """Every PHASELAB_ name mentioned in the package's sources, README.md and docs/, with where first."""
    files = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".c", ".h", ".md")]
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out: dict[str, str] = {}
    for path in files:
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            out.setdefault(name, path.relative_to(ROOT).as_posix())
    return out


def test_every_mentioned_name_is_declared():
    declared = {v.name for v in envs.ALL}
    missing = {n: where for n, where in _mentioned().items() if n not in declared and n not in NOT_VARIABLES}
    assert not missing, f"mentioned but not declared in phaselab/envs.py: {missing}"


def test_declarations_are_unique_and_explained():
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names)), f"declared twice: {sorted(n for n in names if names.count(n) > 1)}"
    assert all(NAME.fullmatch(n) for n in names), names
    assert [v.name for v in envs.ALL if not v.meaning.strip()] == []
    module_level = {v.name for v in vars(envs).values() if isinstance(v, envs.EnvVar)}
    assert module_level == set(names), f"declared but not in envs.ALL: {sorted(module_level - set(names))}"


def test_the_module_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "phaselab.envs"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert all(v.name in out for v in envs.ALL)
    assert out.splitlines()[0].split() == ["name", "default", "meaning"]


def test_an_empty_value_reads_as_unset(monkeypatch):
    var = envs.EnvVar("PHASELAB_TEST_ONLY", "1", "a variable of this test")
    monkeypatch.delenv(var.name, raising=False)
    assert (var.get(), var.raw(), var.off()) == ("1", None, False)
    monkeypatch.setenv(var.name, "")
    assert (var.get(), var.raw(), var.off()) == ("1", "", False)
    monkeypatch.setenv(var.name, "0")
    assert (var.get(), var.raw(), var.off()) == ("0", "0", True)
    monkeypatch.setenv(var.name, "no")
    assert (var.get(), var.off()) == ("no", False)
    unset_default = envs.EnvVar("PHASELAB_TEST_ONLY", None, "no default")
    monkeypatch.setenv(var.name, "")
    assert (unset_default.get(), unset_default.off()) == (None, False)
