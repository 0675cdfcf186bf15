"""Run a training program as one rank of an N-rank world under PyTorch's fake process group:
the memory baseline (c) of benchmarks/fidelity.py.

    python benchmarks/programs/fake_pg.py --rank R --world N -- SCRIPT ARGS

What a user of PyTorch's own tool would do to estimate a rank's memory without the other
ranks: the program's ``init_process_group(...)`` call (whatever backend it names) becomes
``init_process_group("fake", store=FakeStore(), rank=R, world_size=N)``
(``torch.testing._internal.distributed.fake_pg``); every collective then returns at once and
leaves its outputs as they are (no data moves, no value is produced), and every group the
program makes with ``new_group`` is fake too. The program itself runs unmodified, with
torchrun's environment for rank R (``LOCAL_RANK`` 0: one GPU, the first visible one), through
``runpy`` as ``__main__``.

At exit (normal or not) one line on stdout, which the harness parses::

    FAKEPG {"rank": R, "world": N, "exit": 0, "peak_memory_bytes": ..., "error": null}

``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated()`` (-1 when CUDA was never
initialised, e.g. on CPU); ``error`` the last line of an exception that ended the program.
Exit status: the program's.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not 0 <= a.rank < a.world:
        ap.error(f"--rank {a.rank} is outside a world of {a.world}")
    # torchrun's environment for this rank (one process here: LOCAL_RANK 0, one local rank)
    os.environ.update(
        RANK=str(a.rank),
        WORLD_SIZE=str(a.world),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK="0",
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", "29599"),
    )

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    original = dist.init_process_group

    def fake_init(
        backend=None,
        init_method=None,
        timeout=None,
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
        device_id=None,
        **kwargs,
    ):
        extra = {"timeout": timeout} if timeout is not None else {}
        return original("fake", store=FakeStore(), rank=a.rank, world_size=a.world, **extra)

    dist.init_process_group = fake_init
    code, error = 0, None
    sys.argv = [a.script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))
    try:
        runpy.run_path(a.script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - reported on the FAKEPG line, then the status
        traceback.print_exc()
        code = 1
        error = (traceback.format_exception_only(type(e), e)[-1].strip())[:500]
    peak = -1
    try:
        if torch.cuda.is_initialized():
            peak = int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001
        pass
    print(
        "FAKEPG "
        + json.dumps({"rank": a.rank, "world": a.world, "exit": code, "peak_memory_bytes": peak, "error": error}),
        flush=True,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
