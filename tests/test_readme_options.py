"""README's engine-option list names every option EngineArgs declares (and no option it does not):
the declaration in phaselab/engine_args.py is the one source, the README a reader's index of it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from phaselab.engine_args import EngineArgs

README = Path(__file__).resolve().parents[1] / "README.md"


def _option_paragraph() -> str:
    text = README.read_text()
    start = text.index("Engine options (")
    end = text.index("\n\n", start)
    return text[start:end]


def test_readme_lists_every_engine_option():
    names = set(re.findall(r"`([a-z_]+)`", _option_paragraph()))
    declared = {f.name for f in dataclasses.fields(EngineArgs)}
    assert declared - names == set(), f"README.md's engine options miss {sorted(declared - names)}"
    unknown = {n for n in names - declared if "_" in n}
    assert unknown == set(), f"README.md lists options EngineArgs does not declare: {sorted(unknown)}"
