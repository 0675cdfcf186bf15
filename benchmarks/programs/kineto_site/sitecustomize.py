"""Kineto (torch.profiler, CUDA activity) in every Python process of a run whose command line
contains ``KINETO_MATCH``, written to ``KINETO_OUT/<pid>-<name>.json.gz`` when the process ends
(``os._exit`` included, which prism's assistant and ranks end with). For the processes prism
starts itself (the assistant, the sandbox ranks), whose code a benchmark cannot wrap:

    PYTHONPATH=benchmarks/programs/kineto_site KINETO_OUT=out/kineto \
        KINETO_MATCH=prismllm.assistant,collective_sizes.py python benchmarks/pruning_latency.py ...

The kernels, copies and CUDA runtime calls of each process (no CPU ops: the host stays near its
normal pace). Diagnostics only: the timeline of a pruned call on both of its devices."""

import os

_OUT = os.environ.get("KINETO_OUT")


def _cmdline() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start(out: str) -> None:
    import atexit
    import gzip
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    cmd = _cmdline()
    name = next((m for m in os.environ.get("KINETO_MATCH", "").split(",") if m and m in cmd), "proc")
    name = f"{name.replace('/', '_')}-rank{os.environ.get('RANK', 'x')}"
    prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
    prof.start()
    done = []

    def stop() -> None:
        if done:
            return
        done.append(1)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        prof.stop()
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as t:
            tmp = t.name
        prof.export_chrome_trace(tmp)
        with open(tmp) as f, gzip.open(os.path.join(out, f"{os.getpid()}-{name}.json.gz"), "wt") as g:
            g.write(json.dumps({"cmd": cmd, **json.load(f)}))
        os.unlink(tmp)

    real_exit = os._exit

    def _exit(code: int) -> None:
        stop()
        real_exit(code)

    os._exit = _exit
    atexit.register(stop)


if _OUT and any(m and m in _cmdline() for m in os.environ.get("KINETO_MATCH", "").split(",")):
    _start(_OUT)
