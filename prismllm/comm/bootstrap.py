"""Run a training program under the interception: ``python -m prismllm.comm.bootstrap SCRIPT
ARGS...`` behaves like ``python SCRIPT ARGS...``.

The launcher starts one of these per rank with torchrun's environment plus the rank's
:class:`~prismllm.childenv.ChildEnv` (``mode``, ``spool``, ...). Without a mode nothing is
installed: the script just runs. A PrismError raised inside the program (solo mode's tensor
generator: a bad rule, a collective nothing can answer; emulation: a call that deviates from
the graph) is reported to the launcher (``childenv.report_error``) and printed as one line
``prism: error: ...`` to stderr; the exit status is 3, with no traceback.
At exit (normal end, ``sys.exit(n)``, or an exception) the rank's RankLog is written to the
spool -- once, from the process that started (never from forked workers) -- and the
program's own exit status and traceback are kept. A rank log that a full disk or a failing file
system kept from being written is a ``storage`` error reported to the launcher (a program that
ended well then exits 3), and so is such an error of the program's own writes. With
``memory_history`` the rank's allocator history is written too (GPU;
``prismllm.comm.memhistory``). With ``cuda_on_cpu`` (with or without a mode) the program's
CUDA calls run on the CPU (``prismllm.devicemap``).

The interception's modules are imported only when a mode is set: a plain run of the
bootstrap loads nothing of prism's (nor torch) before the program does.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback

from prismllm.childenv import ChildEnv, report_error
from prismllm.errors import PrismError
from prismllm.launch.messages import is_out_of_memory
from prismllm.launch.status import reporter
from prismllm.outdir import storage_problem

USAGE = "usage: python -m prismllm.comm.bootstrap SCRIPT [ARGS...]"


class _Flusher:
    def __init__(self, rec, spool: str | None, history: str | None = None):
        self.rec = rec
        self.spool = spool
        self.history = history  # ChildEnv.memory_history (prismllm.comm.memhistory)
        self.pid = os.getpid()
        self.done = False
        self.lost = False  # the rank log could not be written for a full disk or a failing file system

    def __call__(self) -> None:
        if self.done or self.rec is None or os.getpid() != self.pid:
            return
        self.done = True
        try:
            # only with a mode (rec set): see the module docstring
            from prismllm.comm.install import collect
            from prismllm.comm.recording_work import hold_to_the_end
            from prismllm.trace.ranklog import write_ranklog

            saving = sys.modules.get("prismllm.comm.saving")
            if saving is not None:
                saving.close()
            self.rec.finish()
            hold_to_the_end(self.rec.groups)
            log = collect(self.rec)
            if self.spool:
                os.makedirs(self.spool, exist_ok=True)
                write_ranklog(self.spool, log)
            if self.history:
                # torch's allocator history: only when asked
                from prismllm.comm import memhistory

                memhistory.dump(self.history, self.rec.rank)
        except Exception as e:  # never mask the program's own outcome
            problem = storage_problem(e, self.spool or ".")
            if problem is None:
                print("prism: could not write the rank log:", file=sys.stderr)
                traceback.print_exc()
                return
            self.lost = True
            report_error("storage", problem)
            print(f"prism: error: could not write the rank log: {problem}", file=sys.stderr)


def _program_traceback(tb, script: str):
    """Drop the bootstrap/runpy frames so the traceback starts in the program."""
    target = os.path.abspath(script)
    t = tb
    while t is not None:
        if os.path.abspath(t.tb_frame.f_code.co_filename) == target:
            return t
        t = t.tb_next
    return tb


def _prism_error(e: BaseException):
    """The PrismError behind ``e`` (itself, its cause, or a generator error that a C++
    caller turned into a RuntimeError), or None for the program's own errors."""
    if isinstance(e, PrismError):
        return e
    if isinstance(e.__cause__, PrismError):
        return e.__cause__
    gen = sys.modules.get("prismllm.generate.errors")
    last = gen.last_error() if gen is not None else None
    if last is not None and str(last) in str(e):
        return last
    return None


def _stop(message: str) -> None:
    """Prism stopped the program: report why to the launcher and in one line, exit 3."""
    report_error("prism", message)
    print(f"prism: error: {message}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(3) from None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    script, args = argv[0], argv[1:]
    if not os.path.exists(script):
        print(f"python: can't open file {script!r}: No such file or directory", file=sys.stderr)
        raise SystemExit(2)

    rec = None
    try:
        child = ChildEnv.current()
        if child.mode:
            # torch and the interception: only with a mode
            from prismllm.comm.install import install

            rec = install(child.mode, child)
            if child.spin:
                # torch, only when asked: the spins of prism whatif --spin
                from prismllm.comm.spin import install as install_spin, parse_spins

                install_spin(rec, parse_spins(child.spin))
            if child.head_start:
                # prism time's slices on GPUs: the device sleeps after each wait of the host for it
                from prismllm.comm import headstart

                rec.head_start = child.head_start
                headstart.install(rec.give_head_start)
        if child.cuda_on_cpu:
            # torch, only when asked; after the interception, whose group creation it wraps
            from prismllm import devicemap

            devicemap.install()
        if child.router_module:
            # torch, only when asked: the MoE mock router (prismllm.routing)
            from prismllm.routing.contract import routing_of
            from prismllm.routing.router import install as install_router

            routing = routing_of(child.routing) if child.routing else None
            install_router(child.router_module, routing, child.routing_observe, child.routing_topk)
    except (PrismError, ValueError) as e:
        _stop(str(e))
    status = reporter()  # the launcher's hang diagnosis: where this rank stands, on request
    if status is not None and rec is not None:
        # with the interception, as above
        from prismllm.comm.recorder_status import status_lines

        status.add(lambda: status_lines(rec), rec.progress)
    history = child.memory_history if rec is not None else None
    if history:
        # torch's allocator history: only when asked
        from prismllm.comm import memhistory

        if not memhistory.start(int(os.environ.get("LOCAL_RANK", "0"))):
            history = None
    flush = _Flusher(rec, child.spool, history)
    atexit.register(flush)

    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        flush()
        if flush.lost and not e.code:
            raise SystemExit(3) from None
        raise
    except KeyboardInterrupt:
        flush()
        raise
    except BaseException as e:  # the program's own error: same report, same exit status
        flush()
        perr = _prism_error(e)
        if perr is not None:  # prism's own error (e.g. the tensor generator): one line
            _stop(str(perr))
        text = f"{type(e).__name__}: {e}"
        problem = storage_problem(e, os.getcwd())
        if problem is not None:  # the program's own write: the launcher names the disk, not a traceback
            report_error("storage", problem)
        elif is_out_of_memory(text):  # with where in the program: solo ranks, run apart, are compared by it
            report_error("out_of_memory", text.splitlines()[0], calls=rec.calls() if rec else None)
        tb = _program_traceback(e.__traceback__, script)
        e.__traceback__ = tb
        sys.excepthook(type(e), e, tb)
        sys.stderr.flush()
        raise SystemExit(1) from None
    flush()
    if flush.lost:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
