"""``prism emulate``: the sandbox ranks run the unmodified program for real, one assistant
replays every other rank of the bare graph and meets them in every collective.

Processes, all children of one launcher (``prismllm.capture.launcher``: one TCPStore hosted
by the launcher, every child ended when the run ends, however it ends):

* one per sandbox rank r: ``python -m prismllm.comm.bootstrap SCRIPT ARGS`` with torchrun's
  environment for logical rank r of WORLD_SIZE = N (the graph's world size) and
  ``PRISM_MODE=emulate`` (``prismllm.comm.emulate``);
* one assistant: ``python -m prismllm.replay.assistant`` (``prismllm.replay.assistant``).

The sandbox ranks write their rank logs (what ``prism record`` records, for the slice-timing
stage) into ``OUT/ranklogs``, and ``OUT/emulate.json`` says what ran and how it ended.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from prismllm.capture.launcher import ExtraProcess, LaunchError, LaunchResult, LaunchSpec, LineSink, launch
from prismllm.capture.record import LOGS_DIR, MANIFEST_FILE, TENSORS_DIR
from prismllm.errors import PrismError

RANKLOGS_DIR = "ranklogs"
RESULT_FILE = "emulate.json"


@dataclasses.dataclass
class EmulateOptions:
    graph: str | os.PathLike  # the bare graph (a PrismTrace directory)
    sandbox: str | Sequence[int]  # ranks that run for real: "0,2-3" or a list
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    tensors: str | os.PathLike | None = None  # recorded tensors with inputs (default GRAPH/tensors)
    timeout: float | None = None
    force: bool = False
    tee: bool = False  # per-process log files in OUT/logs
    line_prefix: str | None = None  # e.g. "[rank{rank}]: "
    sink: LineSink | None = None
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)  # extra child env
    extra_grace: float = 30.0  # how long the assistant may outlive the sandbox ranks
    check: bool = False  # compare the sandbox's pruned-call outputs with the recorded ones


@dataclasses.dataclass
class EmulateResult:
    out: Path
    world_size: int
    sandbox: tuple[int, ...]
    returncodes: dict[int, int | None]  # per sandbox rank
    wall_s: float
    launch: LaunchResult
    checks: dict[int, dict] = dataclasses.field(default_factory=dict)  # --check: per sandbox rank


def _world_size(graph: Path) -> int:
    """N from the graph's manifest (no need to load the node tables here)."""
    mf = graph / MANIFEST_FILE
    if not mf.is_file():
        raise PrismError(f"{graph} holds no graph ({MANIFEST_FILE} missing)")
    try:
        ws = json.loads(mf.read_text()).get("world_size")
    except (OSError, ValueError) as e:
        raise PrismError(f"cannot read {mf}: {e}") from None
    if not isinstance(ws, int) or ws < 1:
        raise PrismError(f"{mf} has no world_size")
    return ws


def emulate(opts: EmulateOptions) -> EmulateResult:
    """Run the emulation; raise PrismError (one clear message) on bad input or a failed run."""
    from prismllm.comm.emulate import parse_ranks

    t0 = time.monotonic()
    graph = Path(opts.graph)
    world = _world_size(graph)
    try:
        if isinstance(opts.sandbox, str):
            sandbox = parse_ranks(opts.sandbox)
        else:
            sandbox = tuple(sorted({int(r) for r in opts.sandbox}))
    except ValueError as e:
        raise PrismError(f"--sandbox: {e}") from None
    bad = [r for r in sandbox if not 0 <= r < world]
    if bad or not sandbox:
        raise PrismError(f"--sandbox {opts.sandbox}: ranks must be in 0..{world - 1} (the graph's world)")
    if len(sandbox) == world:
        raise PrismError("every rank is in the sandbox: nothing to emulate (use `prism record`)")
    tensors = Path(opts.tensors) if opts.tensors is not None else graph / TENSORS_DIR
    if not tensors.is_dir() or not any(tensors.glob("rank-*.idx")):
        raise PrismError(f"no recorded tensors in {tensors}: the assistant needs the virtual ranks' inputs "
                         f"(`prism record --save-tensors all,inputs`; --tensors DIR)")
    if not os.path.isfile(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    if opts.timeout is not None and opts.timeout <= 0:
        raise PrismError(f"--timeout must be positive, not {opts.timeout:g}")
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise PrismError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not opts.force:
            raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")
        if not (out / RESULT_FILE).exists():
            raise PrismError(f"output directory {out} is not empty and holds no emulation; "
                             f"refusing to delete it even with --force")
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    ranklogs = out / RANKLOGS_DIR
    ranklogs.mkdir()

    common = {"PRISM_SANDBOX": ",".join(map(str, sandbox)), "PRISM_GRAPH": str(graph.resolve())}
    env: dict[str, str | None] = {
        **common,
        "PRISM_MODE": "emulate",
        "PRISM_SPOOL": str(ranklogs.resolve()),
        "PRISM_DEVICE": "cpu",
        # what torchrun gives each of the N ranks of the real job (nproc > 1): the sandbox
        # runs the recorded ranks' numerics, not a multi-threaded variant of them
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    if opts.check:
        env["PRISM_CHECK_TENSORS"] = str(tensors.resolve())
        env["PRISM_CHECK_OUT"] = str(out.resolve())
    env.update(opts.env)
    assistant = ExtraProcess("assistant", [sys.executable, "-m", "prismllm.replay.assistant"],
                             env={**common, "PRISM_TENSOR_STORE": str(tensors.resolve())})
    spec = LaunchSpec(
        nproc=len(sandbox), script=opts.script, args=list(opts.args), env=env, devices="cpu",
        ranks=list(sandbox), world_size=world, timeout=opts.timeout,
        log_dir=out / LOGS_DIR if opts.tee else None, line_prefix=opts.line_prefix, sink=opts.sink,
        extra=[assistant], extra_grace=opts.extra_grace,
    )
    result = launch(spec)
    wall = time.monotonic() - t0
    codes = {r: result.returncodes.get(r) for r in sandbox}
    checks = {}
    for r in sandbox:
        f = out / f"check-rank-{r}.json"
        if opts.check and f.exists():
            checks[r] = json.loads(f.read_text())
    record: dict[str, Any] = {
        "graph": str(graph.resolve()), "tensors": str(tensors.resolve()), "world_size": world,
        "sandbox": list(sandbox), "command": [opts.script, *opts.args], "ok": result.ok,
        "returncodes": {str(r): c for r, c in codes.items()},
        "assistant_returncode": result.returncodes.get(-1), "wall_s": round(wall, 3),
        "message": result.message,
    }
    if opts.check:
        record["checks"] = {str(r): c for r, c in checks.items()}
    (out / RESULT_FILE).write_text(json.dumps(record, indent=1) + "\n")
    if not result.ok:
        raise LaunchError(result.message, result)
    return EmulateResult(out=out, world_size=world, sandbox=sandbox, returncodes=codes, wall_s=wall,
                         launch=result, checks=checks)


__all__ = ["EmulateOptions", "EmulateResult", "emulate"]
