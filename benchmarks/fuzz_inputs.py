"""Fuzz prism's inputs: seeded mutations of a recorded graph and its tensor store (bit flips,
truncation, empty, deleted and swapped files, bad manifest values, index offsets), each run
through the loaders in-process and, with --cli, through `prism show` and `prism compare` with a
timeout; the outcomes tallied (issue 37).

    python benchmarks/fuzz_inputs.py GRAPH --cases 10000 --seed 1 [--cli] [--work DIR]

GRAPH: a graph recorded with its store (`prism record --save-tensors all,inputs`), unchanged.
Each case copies it, applies one mutation and sorts the outcome into

- refused: a PrismError of one line (the CLI: an exit status of 2 or 3 and one line on stderr);
- accepted-harmless: loaded, and what was loaded equals the original (manifest, tables, every
  store entry and its bytes; the CLI: the same `show` output, `compare` finds them equal);
- accepted-changed: loaded, and something differs (a wrong figure could follow: a failure);
- traceback: any other exception, or a message of more than one line (a failure);
- hang: a case that outlived its timeout (a failure).

With --reseal, a second kind of case: a consistent change (a node's field, an edge, an iteration
or group row, a duration, a manifest value) sealed again, as an edit by hand or a writer's bug
would leave a graph: the checksums hold, so only validation or `prism compare` can tell. Each is
refused, or harmless (the same graph), or noticed (compare against the original reports a
structure, manifest or timing difference); compare-missed (a changed graph compare calls equal)
is a failure.

tests/test_fuzz_inputs.py runs a few hundred cases in-process in the suite.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa

from prismllm.cli.main import main as prism_main
from prismllm.errors import PrismError
from prismllm.generate.store import TensorStore, rank_files, verify_store
from prismllm.trace.compare import compare_traces
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import TENSORS_DIR
from prismllm.trace.validate import validate

OUTCOMES = ("refused", "accepted-harmless", "noticed", "accepted-changed", "compare-missed", "traceback", "hang")
FAILURES = ("accepted-changed", "compare-missed", "traceback", "hang")
# values a manifest key is set to: wrong types, out of range, huge, odd JSON
BAD_VALUES: list[Any] = ["abc", "2", "", [], [1, 2], {}, {"0": 1}, None, True, -1, 0, 1, 2, 3, 2**31, 2**63, 1.5,
                         math.nan, math.inf, "x" * 10_000]  # fmt: skip


# ---------------------------------------------------------------------------------- mutations
def _files(case: Path) -> list[Path]:
    """Every file of the graph and its store, in a stable order."""
    return sorted(p for p in case.rglob("*") if p.is_file())


def _bitflip(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    data = bytearray(f.read_bytes())
    if not data:
        return f"bitflip {f.name}: empty, unchanged"
    flips = rng.randint(1, 8)
    for _ in range(flips):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(data))
    return f"bitflip {f.relative_to(case)} x{flips}"


def _truncate(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    size = f.stat().st_size
    n = rng.randrange(size) if size else 0
    os.truncate(f, n)
    return f"truncate {f.relative_to(case)} to {n} of {size}"


def _empty(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    f.write_bytes(b"")
    return f"empty {f.relative_to(case)}"


def _delete(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    f.unlink()
    return f"delete {f.relative_to(case)}"


def _swap(case: Path, rng: random.Random) -> str:
    """Two files of one kind swapped (two tables, two ranks' data or index files), or two ranks'
    whole stores (the issue's case)."""
    groups = collections.defaultdict(list)
    for f in _files(case):
        groups[f.suffix].append(f)
    store = case / TENSORS_DIR
    ranks = sorted({n[: -len(".idx")] for n in rank_files(store)} if store.is_dir() else set())
    if len(ranks) >= 2 and rng.random() < 0.3:
        a, b = rng.sample(ranks, 2)
        for ext in (".idx", ".bin"):
            _exchange(store / (a + ext), store / (b + ext))
        return f"swap stores {a} and {b}"
    kinds = [v for v in groups.values() if len(v) >= 2]
    if not kinds:
        return "swap: nothing to swap"
    a, b = rng.sample(rng.choice(kinds), 2)
    _exchange(a, b)
    return f"swap {a.relative_to(case)} and {b.relative_to(case)}"


def _exchange(a: Path, b: Path) -> None:
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)


def _manifests(case: Path) -> list[Path]:
    return [p for p in (case / "manifest.json", case / TENSORS_DIR / "manifest.json") if p.is_file()]


def _manifest_value(case: Path, rng: random.Random) -> str:
    """One key of a manifest (top level or one level down) set to a bad value, or removed."""
    f = rng.choice(_manifests(case))
    m = json.loads(f.read_text())
    holder, where = m, ""
    nested = [k for k, v in m.items() if isinstance(v, dict) and v]
    if nested and rng.random() < 0.4:
        where = rng.choice(nested)
        holder = m[where]
    key = rng.choice(sorted(holder))
    if rng.random() < 0.2:
        del holder[key]
        what = "removed"
    else:
        value = rng.choice(BAD_VALUES)
        holder[key] = value
        what = f"= {json.dumps(value)[:30]}"
    f.write_text(json.dumps(m))
    return f"manifest {f.relative_to(case)} {where + '.' if where else ''}{key} {what}"


def _manifest_deep(case: Path, rng: random.Random) -> str:
    f = rng.choice(_manifests(case))
    depth = rng.choice((1000, 100_000))
    f.write_text("[" * depth + "]" * depth)
    return f"manifest {f.relative_to(case)} nested {depth} deep"


def _index_offsets(case: Path, rng: random.Random) -> str:
    """Rewrite one rank's index: every offset set to -1 (the issue's case), or one entry's offset,
    bytes, dtype or shape changed."""
    idx = [p for p in _files(case) if p.suffix == ".idx"]
    if not idx:
        return "index: no index"
    f = rng.choice(idx)
    entries = list(msgpack.Unpacker(open(f, "rb"), raw=False, strict_map_key=False))
    if rng.random() < 0.3:
        for e in entries:
            for t in e["tensors"]:
                t["offset"] = -1
        what = "every offset = -1"
    else:
        e = rng.choice(entries)
        t = rng.choice(e["tensors"])
        field = rng.choice(("offset", "nbytes", "dtype", "shape", "index", "group"))
        t_or_e = e if field in ("index", "group") else t
        t_or_e[field] = {
            "offset": t["offset"] + rng.choice((-1, 1, 4, 1 << 20)),
            "nbytes": t["nbytes"] + rng.choice((-4, 4)),
            "dtype": rng.choice(("float16", "int8", "Tensor", "nope")),
            "shape": rng.choice(([], [0], [1, 2], [-1])),
            "index": e["index"] + 1,
            "group": [],
        }[field]
        what = f"one entry's {field}"
    f.write_bytes(b"".join(msgpack.packb(e, use_bin_type=True) for e in entries))
    return f"index {f.relative_to(case)}: {what}"


MUTATIONS: list[Callable[[Path, random.Random], str]] = [
    _bitflip, _bitflip, _truncate, _empty, _delete, _swap, _manifest_value, _manifest_value, _manifest_deep,
    _index_offsets,
]  # fmt: skip


# ---------------------------------------------------------------------------------- resealed edits
def _set(table: pa.Table, column: str, row: int, value: Any) -> pa.Table:
    values = table.column(column).to_pylist()
    values[row] = value
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))


def _rows(table: pa.Table, keep: list[int]) -> pa.Table:
    return table.take(pa.array(keep, type=pa.int64()))


def _edit_node(t: PrismTrace, rng: random.Random) -> str:
    comm = [i for i, k in enumerate(t.nodes.column("kind").to_pylist()) if k == "comm"]
    row = rng.choice(comm) if comm and rng.random() < 0.8 else rng.randrange(t.nodes.num_rows)
    field = rng.choice(("tag", "async_op", "shape", "label", "iteration", "seq", "in_bytes", "dtype", "reduce_op",
                        "peer", "op", "wait_index", "coalesced", "duration_ns", "issue_ns"))  # fmt: skip
    old = t.nodes.column(field)[row].as_py()
    new = {
        "tag": lambda: (old or 0) + 1,
        "async_op": lambda: not old,
        "shape": lambda: [*(old or []), 1],
        "label": lambda: (old or "") + "x",
        "iteration": lambda: (old if old is not None else 0) + 1,
        "seq": lambda: (old or 0) + 1,
        "in_bytes": lambda: (old or 0) + 4,
        "dtype": lambda: "float16" if old != "float16" else "float32",
        "reduce_op": lambda: "max" if old != "max" else "sum",
        "peer": lambda: (old if old is not None else -1) + 1,
        "op": lambda: "broadcast" if old != "broadcast" else "all_reduce",
        "wait_index": lambda: -1 if (old or -1) >= 0 else (old or 0) + 2,
        "coalesced": lambda: (old if old is not None else -1) + 7,
        "duration_ns": lambda: (old or 0) * 2 + 1000,
        "issue_ns": lambda: (old or 0) + 1000,
    }[field]()
    t.nodes = _set(t.nodes, field, row, new)
    return f"node row {row} {field} {old!r} -> {new!r}"


def _edit_edges(t: PrismTrace, rng: random.Random) -> str:
    n = t.edges.num_rows
    what = rng.choice(("drop", "duplicate", "empty", "kind"))
    if what == "empty" or n == 0:
        t.edges = t.edges.slice(0, 0)
        return "edges emptied"
    row = rng.randrange(n)
    if what == "drop":
        t.edges = _rows(t.edges, [i for i in range(n) if i != row])
    elif what == "duplicate":
        t.edges = _rows(t.edges, [*range(n), row])
    else:
        old = t.edges.column("kind")[row].as_py()
        t.edges = _set(t.edges, "kind", row, "wait" if old != "wait" else "order")
    return f"edge row {row}: {what}"


def _edit_table_rows(t: PrismTrace, rng: random.Random) -> str:
    name = rng.choice(("iterations", "groups"))
    table = getattr(t, name)
    n = table.num_rows
    what = rng.choice(("drop", "duplicate", "label"))
    row = rng.randrange(n) if n else 0
    if n == 0:
        return f"{name}: empty, unchanged"
    if what == "drop":
        table = _rows(table, [i for i in range(n) if i != row])
    elif what == "duplicate":
        table = _rows(table, [*range(n), row])
    else:
        field = "label" if name == "iterations" else "desc"
        table = _set(table, field, row, (table.column(field)[row].as_py() or "") + "x")
    setattr(t, name, table)
    return f"{name} row {row}: {what}"


def _edit_manifest(t: PrismTrace, rng: random.Random) -> str:
    key = rng.choice(("layout", "command", "mode", "world_size", "device", "peak_memory_bytes"))
    old = t.manifest.get(key)
    new = {
        "layout": lambda: {"tp": 2, "pp": 1} if old != {"tp": 2, "pp": 1} else None,
        "command": lambda: [*(old or []), "--extra"],
        "mode": lambda: "solo" if old != "solo" else "record",
        "world_size": lambda: (old or 1) * 2,
        "device": lambda: "cuda" if old != "cuda" else "cpu",
        "peak_memory_bytes": lambda: {str(r): 1 << 20 for r in range(t.world_size)},
    }[key]()
    t.manifest = {**t.manifest, key: new}
    return f"manifest {key} {json.dumps(old)[:40]} -> {json.dumps(new)[:40]}"


RESEALS: list[Callable[[PrismTrace, random.Random], str]] = [_edit_node, _edit_node, _edit_edges, _edit_table_rows,
                                                             _edit_manifest]  # fmt: skip


def reseal(src: Path, case: Path, rng: random.Random) -> str:
    """Write to ``case`` the graph ``src`` with one consistent change, sealed again; its description."""
    t = PrismTrace.load(src, verify=False)
    t.manifest = {k: v for k, v in t.manifest.items() if k not in ("files", "manifest_crc32")}
    what = rng.choice(RESEALS)(t, rng)
    shutil.rmtree(case, ignore_errors=True)
    t.save(case)
    return what


def reseal_outcome(case: Path, original: PrismTrace, timeout_s: float = 10.0) -> tuple[str, str]:
    """(outcome, detail) of a resealed case: refused on load or validation, the same graph, a
    difference `prism compare` reports (structure, manifest or timing), or one it misses."""

    def judged() -> dict | None:
        trace = PrismTrace.load(case)
        validate(trace)
        return None if trace.equals(original) else compare_traces(original, trace).to_dict()

    res, failed = _guarded(judged, timeout_s)
    if failed is not None:
        return failed
    if res is None:
        return "accepted-harmless", ""
    timing = res["timing"] or {}
    moved = (
        timing.get("iteration_time_a_ns") != timing.get("iteration_time_b_ns")
        or any(v.get("a_ns") != v.get("b_ns") for v in (timing.get("compute_ns") or {}).values())
        or bool((timing.get("node_times") or {}).get("differ"))
    )
    if not res["structure"]["equal"] or res["manifest"] or moved:
        return "noticed", ""
    return "compare-missed", "compare found no difference"


def mutate(src: Path, case: Path, rng: random.Random) -> str:
    """Copy the graph ``src`` (with its store) to ``case`` and apply one mutation; its description."""
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(src, case)
    return rng.choice(MUTATIONS)(case, rng)


# ---------------------------------------------------------------------------------- loading
def snapshot(graph: Path) -> tuple[PrismTrace, dict]:
    """What prism reads of a graph and its store, through the loaders that check them: the graph
    (loaded, validated) and per rank every store entry with its tensors' bytes."""
    trace = PrismTrace.load(graph)
    validate(trace)
    store: dict[int, dict] = {}
    root = graph / TENSORS_DIR
    if root.is_dir():
        verify_store(root, trace, str(graph))
        for rank in sorted({int(n[5:11]) for n in rank_files(root)}):
            st = TensorStore(root, rank)
            store[rank] = {
                k: [(str(t.dtype), tuple(t.shape), t.numpy().tobytes()) for t in st.get(*k[:4], peer=k[4], io=k[5])]
                for k in st.entries
            }
    return trace, store


class _Hang(BaseException):  # not an Exception: prism's main turns those into a line
    pass


def _alarm(signum, frame):
    raise _Hang


def _guarded(fn: Callable[[], Any], timeout_s: float) -> tuple[Any, tuple[str, str] | None]:
    """(fn's value, None), or (None, (outcome, detail)) where it was refused in one line, raised
    anything else or a message of several lines (traceback), or outlived ``timeout_s`` (hang)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(), None
    except _Hang:
        return None, ("hang", f"more than {timeout_s:g} s")
    except PrismError as e:
        text = str(e)
        return None, (("refused", text) if "\n" not in text else ("traceback", f"several lines: {text[:200]}"))
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return None, ("traceback", f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load_outcome(case: Path, original: tuple[PrismTrace, dict], timeout_s: float = 10.0) -> tuple[str, str]:
    """(outcome, detail) of loading ``case`` in-process, against the original's snapshot."""
    loaded, failed = _guarded(lambda: snapshot(case), timeout_s)
    if failed is not None:
        return failed
    trace, store = loaded
    same = trace.equals(original[0]) and store == original[1]
    return ("accepted-harmless" if same else "accepted-changed"), ""


# ---------------------------------------------------------------------------------- CLI
SUBPROCESS = False  # --subprocess: each command in a process of its own (as a user runs it), ~1 s a command


def _prism(*argv: str, timeout_s: float) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr) of ``prism ARGV``; None for a command that outlived ``timeout_s``.
    In-process by default: the same ``main`` the console script calls, 50-100 times faster."""
    if SUBPROCESS:
        try:
            p = subprocess.run(
                [sys.executable, "-m", "prismllm.cli.main", *argv], capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return None, "", ""
        return p.returncode, p.stdout, p.stderr
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = prism_main(list(argv))
    except _Hang:
        return None, "", ""
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return rc, out.getvalue(), err.getvalue()


def _shown(out: str) -> dict | None:
    """What `prism show --json` printed but the path, or None where it printed no JSON object."""
    try:
        return {k: v for k, v in json.loads(out).items() if k != "path"}
    except (ValueError, AttributeError):
        return None


def cli_outcome(case: Path, src: Path, original: dict, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail) of `prism show --json CASE` and `prism compare SRC CASE --structure-only`,
    against ``original``, the show of SRC."""
    results = []
    for argv in (("show", str(case), "--json"), ("compare", str(src), str(case), "--structure-only")):
        rc, out, err = _prism(*argv, timeout_s=timeout_s)
        if rc is None:
            return "hang", f"prism {argv[0]}: more than {timeout_s:g} s"
        lines = err.strip().splitlines()
        if "Traceback" in err or rc == 5 or (rc in (2, 3) and len(lines) != 1):
            return "traceback", f"prism {argv[0]} exit {rc}: {err.strip()[-300:]}"
        results.append((argv[0], rc, out, lines))
    (_, rc_show, out_show, err_show), (_, rc_cmp, _, err_cmp) = results
    if rc_show in (2, 3) and rc_cmp in (2, 3):
        return "refused", err_show[0]
    if rc_show == 0 and rc_cmp == 0 and _shown(out_show) == original:
        return "accepted-harmless", ""
    return "accepted-changed", f"show exit {rc_show}, compare exit {rc_cmp}: {(err_show or err_cmp or [''])[0][:200]}"


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph", type=Path, help="a recorded graph with its tensors/ store")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cli", action="store_true", help="also run prism show and prism compare on each case")
    ap.add_argument("--subprocess", action="store_true", help="run each CLI command in a process of its own")
    ap.add_argument("--reseal", type=int, default=0, metavar="M", help="also M resealed edits (see above)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take (each CLI command)")
    ap.add_argument("--work", type=Path, default=None, help="where cases are written (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the tally and the failures here")
    args = ap.parse_args(argv)
    global SUBPROCESS
    SUBPROCESS = args.subprocess

    rng = random.Random(args.seed)
    original = snapshot(args.graph)
    original_shown = _shown(_prism("show", str(args.graph), "--json", timeout_s=args.timeout)[1]) if args.cli else None
    tally = {"in-process": collections.Counter(), "cli": collections.Counter(), "resealed": collections.Counter()}
    failures = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        case = Path(tmp) / "case"
        for i in range(args.cases):
            what = mutate(args.graph, case, rng)
            outcome, detail = load_outcome(case, original, args.timeout)
            tally["in-process"][outcome] += 1
            if outcome in FAILURES:
                failures.append(
                    {"case": i, "mutation": what, "where": "in-process", "outcome": outcome, "detail": detail}
                )
            if args.cli:
                outcome, detail = cli_outcome(case, args.graph, original_shown, args.timeout)
                tally["cli"][outcome] += 1
                if outcome in FAILURES:
                    failures.append({"case": i, "mutation": what, "where": "cli", "outcome": outcome, "detail": detail})
            if (i + 1) % 500 == 0:
                print(
                    f"{i + 1}/{args.cases}: " + "; ".join(f"{k} {dict(v)}" for k, v in tally.items() if v), flush=True
                )
        for i in range(args.reseal):
            what = reseal(args.graph, case, rng)
            outcome, detail = reseal_outcome(case, original[0], args.timeout)
            tally["resealed"][outcome] += 1
            if outcome in FAILURES:
                failures.append(
                    {"case": i, "mutation": what, "where": "resealed", "outcome": outcome, "detail": detail}
                )
    for where, counts in tally.items():
        if counts:
            print(f"{where}: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES))
    for f in failures[:20]:
        print(f"FAILURE {f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"seed": args.seed, "cases": args.cases, "tally": tally, "failures": failures}, indent=1)
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
