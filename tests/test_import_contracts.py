"""The layering of docs/architecture.md ("## Layers") is the code's: every import of a phaselab
module by another package, at module level or inside a function or a TYPE_CHECKING block, must be
one the table there allows. The table is parsed from the doc, so the doc and this test cannot
disagree; a new package or top-level module must get a row before its imports pass.

The truth is the source itself (an AST walk of every module under phaselab/), not an import of the
package: an import hidden inside a function runs only when called, and the earlier boundary tests,
which imported each package and looked for torch, could not see one (analysis/verify.py built an
LLMEngine from inside a function).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
EVERY = "every package"


@dataclass(frozen=True)
class Contracts:
    layer: dict[str, int]  # package (or top-level module) -> its layer number
    allowed: dict[str, frozenset[str]]  # package -> what it may import: a package, or package.module
    base: frozenset[str]  # what every package may import


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


def parse_contracts(text: str) -> Contracts:
    """The "## Layers" table: | layer | package | may import |, the imports comma-separated, "—" for none."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    layer: dict[str, int] = {}
    allowed: dict[str, frozenset[str]] = {}
    base: frozenset[str] = frozenset()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not line.lstrip().startswith("|") or set(cells[0]) <= set("-: "):
            continue
        if cells[0] == "layer":
            continue
        imports = frozenset(x.strip().strip("`") for x in cells[2].split(",") if x.strip().strip("`") not in ("", "—"))
        if cells[1] == EVERY:
            base = imports
            continue
        for name in (x.strip().strip("`") for x in cells[1].split(",")):
            layer[name] = int(cells[0])
            allowed[name] = imports
    assert layer, f"{DOC}: no '## Layers' table of | layer | package | may import |"
    return Contracts(layer, allowed, base)


def _package_of(rel: Path) -> str:
    """phaselab/<pkg>/x.py -> pkg; phaselab/<module>.py -> module."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported phaselab module) for every import statement anywhere in the source; `module`
    is the importer's dotted name (relative imports are resolved against it)."""
    out = []
    parts = module.split(".")[:-1]  # the importer's package (a package's __init__ included)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = parts[:len(parts) - node.level + 1]
                base = ".".join(prefix + ([node.module] if node.module else []))
            # `from phaselab import x` and `from phaselab.pkg import mod` name a module by the imported name
            out += [(node.lineno, f"{base}.{a.name}" if base.count(".") < 2 else base) for a in node.names]
    return [(n, m) for n, m in out if m == "phaselab" or m.startswith("phaselab.")]


def check(root: Path, contracts: Contracts) -> tuple[list[Violation], set[str]]:
    """The violations under root/phaselab, and the packages found that the table does not list."""
    violations: list[Violation] = []
    unlisted: set[str] = set()
    pkg_root = root / "phaselab"
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(pkg_root)
        importer = _package_of(rel)
        if importer in ("__init__", "__main__"):
            continue  # the package root: `phaselab.LLM` loads lazily, above everything
        if importer not in contracts.layer:
            unlisted.add(importer)
            continue
        module = ".".join(("phaselab",) + rel.with_suffix("").parts)
        for line, name in imports_of(path.read_text(encoding="utf-8"), module):
            names = name.split(".")
            if len(names) == 1 or names[1] == "__version__":
                continue  # `import phaselab`: the version string
            target = names[1]
            if target == importer:
                continue
            sub = f"{target}.{names[2]}" if len(names) > 2 else target
            ok = contracts.allowed[importer] | contracts.base
            if target not in ok and sub not in ok:
                violations.append(Violation(str(path.relative_to(root)), line, importer, name))
    return violations, unlisted


def test_imports_follow_the_documented_layers():
    contracts = parse_contracts(DOC.read_text(encoding="utf-8"))
    violations, unlisted = check(ROOT, contracts)
    assert not unlisted, (f"packages or modules missing from docs/architecture.md's Layers table: {sorted(unlisted)}; "
                          "add a row (its layer and what it may import)")
    assert not violations, ("imports the Layers table of docs/architecture.md does not allow (move the code to the "
                            "layer that may import it, or change the table and say why):\n"
                            + "\n".join(map(str, violations)))


def test_the_table_is_layered():
    """Each row may import only rows of a lower layer: the table describes layers, not a graph with cycles."""
    c = parse_contracts(DOC.read_text(encoding="utf-8"))
    for pkg, imports in c.allowed.items():
        for x in imports:
            target = x.split(".")[0]
            assert target in c.layer, f"{pkg} may import {x}, which the table does not list"
            assert c.layer[target] < c.layer[pkg], f"{pkg} (layer {c.layer[pkg]}) may import {x} (layer {c.layer[target]})"
    for x in c.base:
        assert x in c.layer and c.layer[x] == 0, f"{x}, which every package may import, must be a layer-0 row"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "phaselab" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return tmp_path


def test_the_check_finds_a_broken_contract(tmp_path):
    """A test of the test: the real table, a tree whose core imports the engine inside a function and
    under TYPE_CHECKING, an analysis module that builds an engine by a relative import, and the
    allowed imports beside them. Exactly the three forbidden ones are reported."""
    contracts = parse_contracts(DOC.read_text(encoding="utf-8"))
    root = _tree(tmp_path, {
        "core/__init__.py": "",
        "core/x.py": ("from typing import TYPE_CHECKING\nfrom phaselab.errors import ConfigError\n"
                      "if TYPE_CHECKING:\n    from phaselab.engine.engine import LLMEngine\n"
                      "def f():\n    import phaselab.engine.runner\n    from . import y\n"),
        "core/y.py": "import phaselab\nfrom phaselab import __version__\n",
        "analysis/__init__.py": "",
        "analysis/z.py": "from ..engine import engine\nfrom ..obs import rundir\nfrom phaselab.sim import loop\n",
    })
    violations, unlisted = check(root, contracts)
    assert not unlisted
    assert sorted((v.path.split("phaselab/")[1], v.line, v.imported) for v in violations) == [
        ("analysis/z.py", 1, "phaselab.engine.engine"),
        ("core/x.py", 4, "phaselab.engine.engine"),
        ("core/x.py", 6, "phaselab.engine.runner"),
    ]
    # a package the table does not list is reported, not passed
    _, unlisted = check(_tree(tmp_path, {"newpkg/a.py": "from phaselab.core import request\n"}), contracts)
    assert unlisted == {"newpkg"}


def test_module_level_exceptions_are_exact(tmp_path):
    """A row may allow one module of a package (`sim.host`): its siblings stay forbidden."""
    contracts = Contracts({"sim": 1, "engine": 2}, {"sim": frozenset(), "engine": frozenset({"sim.host"})}, frozenset())
    root = _tree(tmp_path, {"engine/a.py": "from phaselab.sim.host import this_cpu\nfrom phaselab.sim import loop\n"
                                           "from phaselab.sim.pricing import CostModel\n"})
    violations, _ = check(root, contracts)
    assert [(v.line, v.imported) for v in violations] == [(2, "phaselab.sim.loop"), (3, "phaselab.sim.pricing")]


def test_every_package_is_in_the_module_map():
    """The Layers table and the module map name the same packages."""
    text = DOC.read_text(encoding="utf-8")
    c = parse_contracts(text)
    module_map = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    for name in c.layer:
        assert re.search(rf"^\s+{re.escape(name)}(/|\.py)", module_map, re.M), f"{name} is in Layers, not in the module map"
