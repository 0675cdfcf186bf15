"""The package's shape (docs/architecture.md): layers that read bottom-up, no import cycle, and
function-level imports only where they say why.

Every ``import`` of a prismllm module counts, at module level or inside a function (a function
runs it sooner or later), except under ``if TYPE_CHECKING:`` (never run). Read from the source
with ``ast``: nothing is imported to check it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "prismllm"

# Bottom-up. A module may import its own layer and the layers below; a stage never another stage.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "prismllm",
            "prismllm.api",
            "prismllm.errors",
            "prismllm.fsutil",
            "prismllm.integrity",
            "prismllm.terminal",
            "prismllm.outdir",
            "prismllm.fromfields",
            "prismllm.specs",
            "prismllm.childenv",
            "prismllm.outputs",
            "prismllm.layout",
            "prismllm.devicemap",
            "prismllm.hostmem",
        ),
    ),
    ("graph format", ("prismllm.trace",)),
    (
        "runtime",
        (
            "prismllm.generate",
            "prismllm.pruning",
            "prismllm.replay",
            "prismllm.launch",
            "prismllm.comm",
            "prismllm.assistant",
            "prismllm.routing",
        ),
    ),
    ("stage", ("prismllm.capture", "prismllm.time", "prismllm.calibrate", "prismllm.emulate", "prismllm.report")),
    ("pipeline", ("prismllm.pipeline",)),
    ("cli", ("prismllm.cli",)),
]
STAGES = dict(LAYERS)["stage"]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


class _Imports(ast.NodeVisitor):
    """(imported module, line, inside a function, has a comment) of one file."""

    def __init__(self, name: str, is_package: bool, known: set[str], lines: list[str]):
        self.name, self.is_package, self.known, self.lines = name, is_package, known, lines
        self.depth = 0
        self.found: list[tuple[str, int, bool, bool]] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, module: str, node: ast.stmt) -> None:
        """A comment on the import's line, or on the line before the block of imports it is in."""
        first = node.lineno - 1
        while first > 0 and self.lines[first - 1].strip().startswith(("import ", "from ")):
            first -= 1
        before = self.lines[first - 1].strip() if first > 0 else ""
        commented = "#" in self.lines[node.lineno - 1] or before.startswith("#")
        self.found.append((module, node.lineno, self.depth > 0, commented))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            pkg = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.known else base, node)


def imports(root: Path = ROOT) -> dict[str, list[tuple[str, int, bool, bool]]]:
    mods = modules(root)
    known = set(mods)
    out = {}
    for name, path in mods.items():
        text = path.read_text()
        v = _Imports(name, path.name == "__init__.py", known, text.splitlines())
        v.visit(ast.parse(text))
        out[name] = v.found
    return out


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the package that places it) of a prismllm module."""
    best = None
    for i, (_, packages) in enumerate(LAYERS):
        for pkg in packages:
            if module == pkg or module.startswith(pkg + ".") and pkg != "prismllm":
                if best is None or len(pkg) > len(best[1]):
                    best = (i, pkg)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: place it")
    return best


def layering_violations(root: Path = ROOT) -> list[str]:
    bad: list[str] = []
    for mod, found in imports_cache(root).items():
        li, lpkg = layer_of(mod)
        for target, line, _, _ in found:
            if target != "prismllm" and not target.startswith("prismllm."):
                continue
            ti, tpkg = layer_of(target)
            where = f"{mod} (line {line}) imports {target}"
            if ti > li:
                bad.append(f"{where}: the {LAYERS[li][0]} layer imports the {LAYERS[ti][0]} layer above it")
            elif lpkg in STAGES and tpkg in STAGES and tpkg != lpkg:
                bad.append(f"{where}: a stage imports another stage (hand it files instead)")
    return list(dict.fromkeys(bad))


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {
        m: sorted({t for t, *_ in found if t in imports_cache(root) and t != m})
        for m, found in imports_cache(root).items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


_CACHE: dict[Path, dict] = {}


def imports_cache(root: Path) -> dict[str, list[tuple[str, int, bool, bool]]]:
    if root not in _CACHE:
        _CACHE[root] = imports(root)
    return _CACHE[root]


def test_every_module_imports_only_its_layer_and_below():
    assert layering_violations() == []


def test_no_import_cycle():
    assert import_cycles() == []


def test_function_level_imports_say_why():
    """An import inside a function is one the module's import would pay for and that some
    paths never need (torch before a plain program runs, a C++ extension, a plotting library):
    each says so in a comment on its line or the line before."""
    silent = [
        f"{mod}:{line} {target}"
        for mod, found in imports_cache(ROOT).items()
        for target, line, in_function, commented in found
        if in_function and not commented
    ]
    assert silent == []


@pytest.mark.parametrize(
    "source,expected",
    [
        ("from prismllm.emulate.run import emulate\n", "a stage imports another stage"),
        ("from prismllm.capture import record\n", "the runtime layer imports the stage layer above it"),
    ],
)
def test_the_check_fails_on_a_stage_or_runtime_that_imports_upwards(tmp_path, source, expected):
    """The checks see what they must: a stage importing another stage, the runtime importing a
    stage (the shape the package had before: prism time imported prism emulate)."""
    pkg = tmp_path / "prismllm"
    for sub in ("time", "emulate", "capture", "comm"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "emulate" / "run.py").write_text("")
    (pkg / "capture" / "record.py").write_text("")
    where = pkg / ("time" if "emulate" in source else "comm") / "mod.py"
    where.write_text(source)
    bad = layering_violations(pkg)
    assert len(bad) == 1 and expected in bad[0], bad


def test_the_cycle_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "prismllm"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "comm" / "__init__.py").write_text("")
    (pkg / "comm" / "a.py").write_text("def f():\n    from prismllm.comm import b  # later\n")
    (pkg / "comm" / "b.py").write_text("from prismllm.comm.a import f\n")
    assert import_cycles(pkg) == [["prismllm.comm.a", "prismllm.comm.b"]]


def test_a_rank_that_reads_only_the_schema_loads_no_assembly():
    """Solo and sandbox ranks read the graph's schema only: the package's other names are loaded
    on first use (each rank process would pay ~0.1 s for assembly and pyarrow.compute), and
    ``validate``/``assemble`` stay the functions once their submodules are loaded."""
    code = (
        "import sys, prismllm.comm.solo\n"
        "print(sorted(m for m in ('prismllm.trace.assemble', 'prismllm.trace.validate', 'pyarrow.compute') "
        "if m in sys.modules))\n"
        "import prismllm.trace.validate, prismllm.trace.assemble\n"
        "from prismllm.trace import PrismTrace, assemble, validate\n"
        "print(callable(validate) and callable(assemble) and PrismTrace.__name__)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["[]", "PrismTrace"], p.stdout


if __name__ == "__main__":  # python tests/test_layering.py [PACKAGE_DIR]: the checks, printed
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    for line in layering_violations(root):
        print("layering:", line)
    for cycle in import_cycles(root):
        print("cycle:", " <-> ".join(cycle))
