"""Docstrings and docs that cannot go stale: every repository path they name exists (a module
moved or deleted leaves no reference behind). Paths are those under the repository's top folders
(``prismllm/…``, ``tests/…``, ``benchmarks/…``, ``docs/…``, ``examples/…``) or under a package of
``prismllm`` written from inside it (``replay/engine.py``); a name with a wildcard or a
placeholder is a pattern, and a benchmark's own result file (``benchmarks/results/…`` named in
``benchmarks/``) is an output it writes, not a reference."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "prismllm").iterdir() if p.is_dir() and not p.name.startswith("_"))
NAMED = re.compile(
    r"(?<![\w/.-])((?:prismllm|tests|benchmarks|docs|examples)/[\w./-]*\w\.(?:py|md|json|sh|cpp)"
    rf"|(?:{'|'.join(PACKAGES)})/[\w/]*\w\.py|DESIGN\.md)"
)


def _texts() -> list[Path]:
    return [
        *ROOT.glob("prismllm/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/**/*.py"),
        *ROOT.glob("examples/**/*.py"),
        *ROOT.glob("docs/**/*.md"),
        ROOT / "README.md",
    ]


def test_every_path_a_docstring_or_doc_names_exists():
    missing = []
    for f in _texts():
        if f == Path(__file__).resolve():  # names the patterns it looks for
            continue
        for m in NAMED.finditer(f.read_text(errors="replace")):
            name = m.group(1)
            if "*" in name or "<" in name:
                continue
            if name.startswith("benchmarks/results/") and f.is_relative_to(ROOT / "benchmarks"):
                continue
            if name == "DESIGN.md" or not ((ROOT / name).exists() or (ROOT / "prismllm" / name).exists()):
                missing.append(f"{f.relative_to(ROOT)}: {name}")
    assert not missing, "named but not in the repository (DESIGN.md is outside it):\n" + "\n".join(missing)
