"""PrismTrace: the execution graph in memory, and its directory on disk.

A graph is four Arrow tables (``nodes``, ``edges``, ``groups``, ``iterations``; schemas in
:mod:`prismllm.trace.schema`) plus a JSON manifest. Everything is columnar: loading never
builds a Python object per row, so an 8192-rank graph loads in seconds.

    trace = PrismTrace.load("out/graph")      # TraceError (a PrismError) on any problem
    trace.world_size, trace.ranks()           # manifest / node columns
    trace.nodes_of(3)                         # the rank's nodes, a zero-copy table slice
    trace.column("in_bytes")                  # a node column as numpy
    trace.save("out/graph2")                  # atomic: temp directory + rename

The manifest on disk is sealed (:mod:`prismllm.integrity`): it lists each table file with its
size and CRC-32, and its own values' CRC-32; loading checks them unless ``verify=False``. The
seal describes the directory, not the graph: ``trace.manifest`` holds the graph's values alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prismllm.errors import InputError, PrismError
from prismllm.fsutil import write_dir_atomically
from prismllm.integrity import check_sealed, sealed, unsealed
from prismllm.trace.schema import (
    EDGE_SCHEMA,
    FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUP_SCHEMA,
    ITERATION_SCHEMA,
    MANIFEST_FILE,
    MANIFEST_VALUES,
    MAX_WORLD_SIZE,
    NODE_DEFAULTS,
    NODE_SCHEMA,
)


def string_codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[str]]:
    """A string column as (int32 codes, the distinct values they index; -1 for a null): no
    Python string per row."""
    if isinstance(col, pa.Array):
        col = pa.chunked_array([col])
    chunks = pc.dictionary_encode(col).unify_dictionaries().chunks
    if not chunks:
        return np.zeros(0, dtype=np.int32), []
    codes = np.concatenate([pc.fill_null(c.indices, -1).to_numpy() for c in chunks]).astype(np.int32)
    return codes, [str(x) for x in chunks[0].dictionary.to_pylist()]


def strings_as_objects(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A string column as a numpy object array whose equal values are one Python object: a node
    column holds a handful of distinct values (ops, streams, dtypes), and a str per row costs
    ~70 bytes (1.3 GB a column at 19 M nodes) where a shared one costs the 8 of its pointer."""
    codes, words = string_codes(col)
    return np.array([*words, None], dtype=object)[codes]  # code -1 (a null): the last one


class TraceError(InputError):
    """A graph that cannot be built, read or trusted; the message says what and where."""


_SCHEMAS = {name: schema for name, (_, schema) in FILES.items()}


def empty_table(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


@dataclasses.dataclass
class PrismTrace:
    manifest: dict[str, Any]
    nodes: pa.Table
    edges: pa.Table
    groups: pa.Table
    iterations: pa.Table

    def __post_init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self.partial = False  # some ranks' nodes only, no edges (``load(ranks=...)``)

    # ------------------------------------------------------------------ accessors
    @property
    def world_size(self) -> int:
        ws = self.manifest.get("world_size")
        if ws is None:
            r = self.column("rank")
            ws = int(r.max()) + 1 if len(r) else 0
        return int(ws)

    @property
    def num_nodes(self) -> int:
        return self.nodes.num_rows

    def column(self, name: str) -> np.ndarray:
        """A node column as a numpy array (cached; strings come back as object arrays)."""
        key = "col:" + name
        if key not in self._cache:
            col = self.nodes.column(name)
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                arr = strings_as_objects(col)
            elif pa.types.is_list(col.type):
                raise TypeError(f"{name} is a list column; use trace.nodes.column({name!r})")
            else:
                arr = col.to_numpy()
            self._cache[key] = arr
        return self._cache[key]

    def program_order(self) -> np.ndarray:
        """Row numbers of the nodes in (rank, index) order: each rank's program order, ranks
        ascending (cached; the identity when the rows are stored so, as assemble writes them)."""
        if "order" not in self._cache:
            rank = self.column("rank").astype(np.int64)
            index = self.column("index").astype(np.int64)
            if len(rank) < 2 or (
                bool(np.all(rank[1:] >= rank[:-1])) and bool(np.all((index[1:] > index[:-1]) | (rank[1:] != rank[:-1])))
            ):
                order = np.arange(len(rank), dtype=np.int64)
            else:
                order = np.lexsort((index, rank)).astype(np.int64)
            order.flags.writeable = False  # shared by every caller
            self._cache["order"] = order
        return self._cache["order"]

    def ranks(self) -> np.ndarray:
        """The ranks that have nodes, ascending."""
        return np.unique(self.column("rank"))

    def _rank_bounds(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ranks, starts) when nodes are sorted by rank (as assemble writes them), else None."""
        if "bounds" not in self._cache:
            r = self.column("rank")
            if len(r) and bool(np.all(r[1:] >= r[:-1])):
                starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
                self._cache["bounds"] = (r[starts], np.r_[starts, len(r)])
            else:
                self._cache["bounds"] = None
        return self._cache["bounds"]

    def nodes_of(self, rank: int) -> pa.Table:
        """The nodes of one rank in program order (a zero-copy slice for an assembled graph)."""
        b = self._rank_bounds()
        if b is not None:
            ranks, bounds = b
            i = int(np.searchsorted(ranks, rank))
            if i < len(ranks) and ranks[i] == rank:
                return self.nodes.slice(bounds[i], bounds[i + 1] - bounds[i])
            return self.nodes.slice(0, 0)
        mask = self.column("rank") == rank
        t = self.nodes.filter(pa.array(mask))
        return t.take(pa.array(np.argsort(t.column("index").to_numpy(), kind="stable")))

    def group_info(self) -> dict[int, dict[str, Any]]:
        """group id -> {"name", "desc", "ranks"} (the groups table is small)."""
        if "groups" not in self._cache:
            g = self.groups.to_pydict()
            self._cache["groups"] = {
                int(gid): {"name": n, "desc": d, "ranks": list(r)}
                for gid, n, d, r in zip(g["group_id"], g["name"], g["desc"], g["ranks"])
            }
        return self._cache["groups"]

    def group_label(self, gid: int) -> str:
        """A short human name for a group: ``"1 ('tp', ranks 0-1)"``."""
        if gid < 0:
            return "none"
        info = self.group_info().get(int(gid))
        if info is None:
            return f"{gid} (unknown)"
        desc = group_desc(info)
        if not desc:
            return f"{gid} ({_ranks_text(info['ranks'])})"
        return f"{gid} ('{desc}', {_ranks_text(info['ranks'])})"

    def has_times(self) -> bool:
        return bool(len(self.column("end_ns"))) and bool(np.any(self.column("end_ns") >= 0))

    # ------------------------------------------------------------------ equality
    def equals(self, other: PrismTrace) -> bool:
        return (
            self.manifest == other.manifest
            and self.nodes.equals(other.nodes)
            and self.edges.equals(other.edges)
            and self.groups.equals(other.groups)
            and self.iterations.equals(other.iterations)
        )

    # ------------------------------------------------------------------ disk
    def save(self, path: str | os.PathLike) -> Path:
        """Write the graph directory atomically: a temp directory beside it, then a rename.

        An existing graph at ``path`` is replaced; any other non-empty directory is refused.
        """

        if self.partial:
            raise PrismError("a graph loaded with some ranks' nodes only cannot be saved")

        def fill(tmp: Path) -> None:
            for name, (fname, schema) in FILES.items():
                table = _conform(getattr(self, name), schema, name)
                pq.write_table(table, tmp / fname, compression="zstd", row_group_size=1 << 20)
            manifest = dict(self.manifest)
            manifest.setdefault("format", FORMAT_NAME)
            manifest.setdefault("format_version", FORMAT_VERSION)
            # JSON values first (numpy numbers, paths, integer keys): the seal's checksum is of
            # what a reader parses back
            manifest = json.loads(json.dumps(manifest, default=_json_default))
            with open(tmp / MANIFEST_FILE, "w") as f:
                json.dump(sealed(manifest, tmp, (fname for fname, _ in FILES.values())), f, indent=2, sort_keys=True)
                f.write("\n")

        # a path that holds something else: a usage error, not one of a graph read
        return write_dir_atomically(path, MANIFEST_FILE, fill, PrismError, "graph")

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        verify: bool = True,
        ranks: Callable[[dict[str, Any], pa.Table], np.ndarray | None] | None = None,
    ) -> PrismTrace:
        """The graph at ``path``, its manifest and tables checked; with ``verify`` (the default)
        its manifest's seal and every table file's size and checksum first (TraceError naming
        the file). ``verify=False`` is for a graph checked already, or a user's --no-verify.

        ``ranks(manifest, groups)``: the ranks whose nodes and iterations to read (None: all),
        for a reader that needs a few ranks of a large graph (an assistant that leaves the DP
        replicas' copies out); such a trace has no edges, is marked ``partial`` and is not saved."""
        path = Path(path)
        manifest = _checked_manifest(path, verify)
        tables: dict[str, pa.Table] = {}
        keep = None
        # with ``ranks`` the groups first: it reads them
        for name in ("groups", "iterations", "nodes", "edges") if ranks is not None else FILES:
            fname, schema = FILES[name]
            fpath = path / fname
            if not fpath.is_file():
                raise TraceError(f"graph {path} is missing {fname}; the graph is incomplete, re-record it")
            if name == "iterations" and ranks is not None:
                keep = ranks(manifest, tables["groups"])
            try:
                if keep is None:
                    table = pq.read_table(fpath, memory_map=True)
                    columns, table_schema = table.columns, table.schema
                    del table  # each column's chunks freed as it is joined: never the table twice
                    table = _joined(columns, table_schema)
                elif name == "edges":
                    table = schema.empty_table()
                else:
                    table = read_rows_of_ranks(fpath, keep)
            except (pa.ArrowException, OSError, ValueError) as e:
                raise TraceError(
                    f"graph {path}: {fname} is unreadable, truncated or corrupt ({_short(e)}); re-record the graph"
                ) from None
            tables[name] = _conform(table, schema, name, where=f"graph {path}: {fname}")
            _check_table(tables[name], schema, manifest["world_size"], f"graph {path}: {fname}")
        trace = cls(manifest=manifest, **tables)
        trace.partial = keep is not None
        return trace


def read_manifest(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """A graph's manifest without its tables (what a stage checks before it runs anything),
    its values checked as :meth:`PrismTrace.load` checks them, and with ``verify`` its seal
    and its table files' checksums too; TraceError naming the problem otherwise."""
    return _checked_manifest(Path(path), verify)


def _checked_manifest(path: Path, verify: bool) -> dict[str, Any]:
    """The manifest of the graph at ``path``, without the seal's keys: the one place a graph's
    manifest is read, and its values checked (format, version, world size, the types of
    :data:`MANIFEST_VALUES`), then with ``verify`` its seal: its own checksum, and every table
    file's size and checksum (a graph written before seals is read unchecked)."""
    if not path.exists():
        raise TraceError(f"graph {path} does not exist")
    if not path.is_dir():
        raise TraceError(f"graph {path} is not a directory (a graph is a directory with {MANIFEST_FILE})")
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise TraceError(
            f"graph {path} has no {MANIFEST_FILE}: not a PrismTrace graph, or an incomplete one; re-record it"
        )
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except RecursionError:
        raise TraceError(
            f"graph {path}: {MANIFEST_FILE} nests too deep to be a manifest; re-record the graph"
        ) from None
    except (OSError, ValueError) as e:
        raise TraceError(f"graph {path}: {MANIFEST_FILE} is unreadable ({_short(e)}); re-record the graph") from None
    if not isinstance(manifest, dict):
        raise TraceError(f"graph {path}: {MANIFEST_FILE} is not a JSON object; re-record the graph")
    fmt = manifest.get("format")
    if fmt != FORMAT_NAME:
        raise TraceError(f"graph {path}: {MANIFEST_FILE} has format {fmt!r}, expected {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if not _whole(version) or version < 1:
        raise TraceError(f"graph {path}: {MANIFEST_FILE} has no format_version of 1 or more")
    if version > FORMAT_VERSION:
        raise TraceError(
            f"graph {path} has format version {version}, newer than this prismllm reads "
            f"({FORMAT_VERSION}): upgrade prismllm"
        )
    _check_values(manifest, f"graph {path}: {MANIFEST_FILE}")
    if verify:
        tables = [fname for fname, _ in FILES.values()]
        check_sealed(manifest, path, tables, f"graph {path}", TraceError, "re-record the graph")
    return unsealed(manifest)


def _whole(v: Any) -> bool:
    """An integer of JSON (not a bool, which Python counts as one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# what each kind of MANIFEST_VALUES accepts
_KINDS: dict[str, Callable[[Any], bool]] = {
    "a string": lambda v: isinstance(v, str),
    "a list of strings": _strings,
    "a string or a list of strings": lambda v: isinstance(v, str) or _strings(v),
    "true or false": lambda v: isinstance(v, bool),
    "an object": lambda v: isinstance(v, dict),
}
# the layout's sizes (prismllm.layout.Layout; ``edp`` as its to_dict writes it)
_LAYOUT_SIZES = ("tp", "cp", "ep", "pp", "dp", "edp")


def _check_values(m: dict[str, Any], where: str) -> None:
    """The manifest's values that prism reads, by type and range: TraceError naming the field."""
    if "world_size" not in m:
        raise TraceError(f"{where} has no world_size; re-record the graph")
    ws = m["world_size"]
    if not _whole(ws) or not 1 <= ws <= MAX_WORLD_SIZE:
        raise _bad_value(where, "world_size", ws, f"a whole number from 1 to {MAX_WORLD_SIZE}")
    for key, kind in MANIFEST_VALUES.items():
        v = m.get(key)
        if v is not None and not _KINDS[kind](v):
            raise _bad_value(where, key, v, kind)
    for k, v in (m.get("layout") or {}).items():
        if k in _LAYOUT_SIZES and not (_whole(v) and 1 <= v <= MAX_WORLD_SIZE):
            raise _bad_value(where, f"layout.{k}", v, "a whole number of 1 or more")
    for r, b in (m.get("peak_memory_bytes") or {}).items():
        if not re.fullmatch(r"[0-9]+", r) or int(r) >= ws:
            raise TraceError(
                f"{where}: peak_memory_bytes has {_shown(r)}, not a rank of the world of {ws}; re-record the graph"
            )
        if not _whole(b) or b < -1:
            raise _bad_value(where, f"peak_memory_bytes.{r}", b, "a whole number of bytes (-1: not measured)")


def _bad_value(where: str, field: str, value: Any, expected: str) -> TraceError:
    return TraceError(f"{where}: {field} is {_shown(value)}, expected {expected}; re-record the graph")


def _shown(v: Any) -> str:
    """A value as a message shows it: a scalar as written (shortened), a container by its kind
    (its repr could be huge, or nest deeper than repr can go)."""
    if isinstance(v, dict | list):
        return f"{'an object' if isinstance(v, dict) else 'a list'} of {len(v)}"
    s = json.dumps(v) if v is None or isinstance(v, bool | float) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _check_table(table: pa.Table, schema: pa.Schema, world_size: int, where: str) -> None:
    """No null in a column of the format; every rank a table names inside the manifest's world."""
    for field in schema:
        col = table.column(field.name)
        if col.null_count:
            raise TraceError(f"{where}: column {field.name!r} has {col.null_count} null value(s); re-record the graph")
    if "rank" in schema.names:
        ranks = table.column("rank")
    elif "ranks" in schema.names:
        ranks = pc.list_flatten(table.column("ranks"))
    else:
        return
    if len(ranks):
        lo, hi = pc.min_max(ranks).values()
        bad = lo.as_py() if lo.as_py() < 0 else hi.as_py()
        if not 0 <= bad < world_size:
            raise TraceError(
                f"{where}: rank {bad} is outside the world of {world_size} (manifest's world_size); re-record the graph"
            )


# ---------------------------------------------------------------------- helpers
def _joined(columns: list[pa.ChunkedArray], schema: pa.Schema) -> pa.Table:
    """A table of ``columns``, each joined into one chunk in turn (the list's own entries are
    replaced, so a column's row-group chunks go as its joined copy comes). A numeric column of
    one chunk is a numpy array without a copy (``trace.column``, the checks, the solve): at
    19 M nodes a column's copy is 150 MB, and a stage takes a dozen."""
    for i in range(len(columns)):
        if columns[i].num_chunks > 1:
            columns[i] = pa.chunked_array([columns[i].combine_chunks()], type=columns[i].type)
    return pa.Table.from_arrays(columns, schema=schema)


def read_rows_of_ranks(path: Path, ranks: np.ndarray) -> pa.Table:
    """The rows of a table file (a graph's, a calibration's) whose ``rank`` is in ``ranks``, one
    row group at a time (a filtered read decodes several at once: 0.6 GB for the few ranks of a
    32,768-rank graph); row groups whose statistics hold none of them are skipped."""
    ranks = np.unique(np.asarray(ranks, dtype=np.int64))
    f = pq.ParquetFile(path, memory_map=True)
    col = f.schema_arrow.get_field_index("rank")
    wanted = pa.array(ranks).cast(f.schema_arrow.field(col).type)
    parts = []
    for i in range(f.num_row_groups):
        stats = f.metadata.row_group(i).column(col).statistics
        if stats is not None and stats.has_min_max:
            lo, hi = np.searchsorted(ranks, [stats.min, stats.max + 1])
            if lo == hi:
                continue
        group = f.read_row_group(i)
        parts.append(group.filter(pc.is_in(group.column("rank"), value_set=wanted)))
    return pa.concat_tables(parts) if parts else f.schema_arrow.empty_table()


_TABLE_DEFAULTS: dict[str, dict[str, object]] = {"nodes": NODE_DEFAULTS}


def _conform(table: pa.Table, schema: pa.Schema, name: str, where: str | None = None) -> pa.Table:
    """Schema columns first, in schema order and type; columns added by a later prismllm of the
    same format version are kept after them; a missing column with a default is filled."""
    where = where or f"{name} table"
    if table.schema.equals(schema):
        return table
    defaults = _TABLE_DEFAULTS.get(name, {})
    cols, fields = [], []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            if not col.type.equals(field.type):
                try:
                    col = col.cast(field.type)
                except (pa.ArrowException, ValueError):
                    raise TraceError(
                        f"{where}: column {field.name!r} has type {col.type}, expected "
                        f"{field.type}; re-record the graph"
                    ) from None
        elif field.name in defaults:
            col = pa.repeat(pa.scalar(defaults[field.name], type=field.type), table.num_rows)
        else:
            missing = [f.name for f in schema if f.name not in table.column_names and f.name not in defaults]
            raise TraceError(f"{where} lacks column(s) {', '.join(missing)}; re-record the graph")
        cols.append(col)
        fields.append(field)
    for cname in table.column_names:
        if cname not in schema.names:
            cols.append(table.column(cname))
            fields.append(table.schema.field(cname))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return s if len(s) <= 160 else s[:157] + "..."


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def group_desc(info: dict[str, Any]) -> str:
    """A group's description if it has a meaningful one (torch's default is "undefined")."""
    d = info.get("desc") or ""
    return "" if d in ("undefined", "None") else d


def _ranks_text(ranks: list[int]) -> str:
    """Compact rank list: "ranks 0-3", "ranks 0,2,4,6", "ranks 0-7 (step 2)"."""
    n = len(ranks)
    if n == 0:
        return "no ranks"
    if n == 1:
        return f"rank {ranks[0]}"
    step = ranks[1] - ranks[0]
    if step > 0 and all(ranks[i + 1] - ranks[i] == step for i in range(n - 1)):
        if step == 1:
            return f"ranks {ranks[0]}-{ranks[-1]}"
        if n > 4:
            return f"ranks {ranks[0]}-{ranks[-1]} step {step}"
    if n <= 8:
        return "ranks " + ",".join(map(str, ranks))
    return "ranks " + ",".join(map(str, ranks[:4])) + f",...({n})"


ranks_text = _ranks_text

__all__ = [
    "PrismTrace",
    "TraceError",
    "empty_table",
    "group_desc",
    "ranks_text",
    "NODE_SCHEMA",
    "EDGE_SCHEMA",
    "GROUP_SCHEMA",
    "ITERATION_SCHEMA",
]
