"""The assistant process: ``python -m prismllm.assistant`` (started by the sandbox launch,
``prismllm.launch.sandbox``). What it does: ``prismllm.assistant.proxy``."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from prismllm.assistant.proxy import Assistant, AssistantError
from prismllm.childenv import ChildEnv, report_error, user_setting, variable
from prismllm.comm.leftout import LeftOutBoard
from prismllm.errors import PrismError
from prismllm.hostmem import peak_rss_bytes
from prismllm.launch.status import reporter
from prismllm.outdir import storage_problem
from prismllm.replay.graph import MirrorError
from prismllm.trace.graph import PrismTrace
from prismllm.trace.worlds import plan_of


def main() -> int:
    t0 = time.monotonic()
    status = reporter()  # the launcher's hang diagnosis: its stacks from the start, its proxies once made
    child: ChildEnv | None = None
    try:
        child = ChildEnv.current()
        inputs = child.inputs or "recorded"
        need = [variable(k) for k in ("sandbox", "graph") if getattr(child, k) is None]
        if not os.environ.get("MASTER_PORT"):
            need.insert(0, "MASTER_PORT")
        if inputs == "recorded" and not child.tensor_store:
            need.append(f"{variable('tensor_store')} (or {variable('inputs')}=generated)")
        if need:
            raise AssistantError(f"missing environment: {', '.join(need)}")
        sandbox = child.sandbox

        def played(manifest: dict, groups: Any) -> Any:
            """The ranks whose nodes the assistant reads: the DP replicas' copies it leaves out
            of its replay are not read either (prismllm.replay.mirror)."""
            mirror = plan_of(manifest, groups, sandbox)
            return None if mirror is None else np.flatnonzero(mirror < 0)

        # the stage that launched it verified the graph
        trace = PrismTrace.load(child.graph, verify=False, ranks=played)
        bad = [r for r in child.sandbox if not 0 <= r < trace.world_size]
        if bad:
            raise AssistantError(f"sandbox rank(s) {bad} outside the graph's world of {trace.world_size}")
        timeout = timedelta(seconds=child.timeout_s if child.timeout_s is not None else 1800.0)
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])

        def connect() -> Any:
            return dist.TCPStore(addr, port, is_master=False, timeout=timeout)

        connect()  # fail here, with one message, if the store cannot be reached
        backend = child.emulate_backend or "gloo"
        if backend == "nccl" and not torch.cuda.is_available():
            raise AssistantError(f"{variable('emulate_backend')}=nccl but this assistant sees no GPU")
        store = child.tensor_store if inputs == "recorded" else None
        try:
            ahead = int(user_setting("PRISM_STAGE_AHEAD", "1"))
        except ValueError:
            raise AssistantError(
                f"PRISM_STAGE_AHEAD={user_setting('PRISM_STAGE_AHEAD')!r}: expected a number of calls"
            ) from None
        index, count = child.assistant_index or 0, child.assistants or 1
        args = (child.sandbox, store, connect, timeout, backend, child.replay_timing or "fast", ahead, index, count)
        # a CPU emulation's virtual ranks keep the sandbox ranks' clock (comm.leftout)
        left_out = LeftOutBoard(child.left_out_board).mean_ns if child.left_out_board else None
        try:
            a = Assistant(trace, *args, left_out=left_out)
        except MirrorError:  # a pair of calls across DP replicas: every rank read and replayed
            a = Assistant(PrismTrace.load(child.graph, verify=False), *args, copies=False, left_out=left_out)
        if status is not None:
            status.add(a.status_lines, a.progress)
        a.run()
        if child.replay_out:
            a.write_result(child.replay_out)
    except (PrismError, ValueError, OSError, RuntimeError) as e:
        # a write that names no path: the replay plan's, the assistant's one file
        problem = storage_problem(e, (child and child.replay_out) or os.getcwd())
        if problem is None:
            report_error("assistant", str(e))
        else:
            report_error("storage", problem)
        print(f"prism assistant: error: {e}", file=sys.stderr, flush=True)
        return 1
    virt = a.graph.ranks

    rss = peak_rss_bytes()
    gpu = ""
    if a.device is not None:
        # its own tensors' peak (PyTorch's allocator), and the whole device in use: context,
        # NCCL and tensors, with any other process's on a GPU the sandbox ranks share
        free, total = torch.cuda.mem_get_info(a.device)
        own = torch.cuda.max_memory_reserved(a.device)
        gpu = f", GPU memory reserved {own / 2**20:.0f} MiB at peak (device in use {(total - free) / 2**20:.0f} MiB)"
    who = "prism assistant" if a.count == 1 else f"prism assistant {a.index} of {a.count}"
    print(
        f"{who}: replayed {len(virt)} virtual rank(s)"
        + (f" and moved {a.mirrored} copies of them with them" if a.mirrored else "")
        + f" ({a.graph.num_nodes} nodes, {a.timing} timing), answered "
        f"{a.answered} collective(s) with the sandbox ({a.staged_hits} staged ahead) on {len(a.groups)} group(s) in "
        f"{time.monotonic() - t0:.1f} s; peak RSS {rss / 2**20:.0f} MiB{gpu}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo worker threads of daemon groups
