"""Run a training program under the interception: ``python -m prismllm.comm.bootstrap SCRIPT
ARGS...`` behaves like ``python SCRIPT ARGS...``.

The launcher starts one of these per rank with torchrun's environment plus ``PRISM_MODE``
and ``PRISM_SPOOL``. With ``PRISM_MODE`` unset nothing is installed: the script just runs.
A PrismError raised inside the program (solo mode's tensor generator: a bad rule, a
collective nothing can answer) is printed as one line ``prism: error: ...`` to stderr and the
exit status is 3, with no traceback.
At exit (normal end, ``sys.exit(n)``, or an exception) the rank's RankLog is written to
``$PRISM_SPOOL`` -- once, from the process that started (never from forked workers) -- and
the program's own exit status and traceback are kept. ``PRISM_MEMORY_HISTORY=<dir>`` also
writes the rank's allocator history there (GPU; ``prismllm.comm.memhistory``).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback

USAGE = "usage: python -m prismllm.comm.bootstrap SCRIPT [ARGS...]"


class _Flusher:
    def __init__(self, rec, spool: str | None, history: str | None = None):
        self.rec = rec
        self.spool = spool
        self.history = history  # PRISM_MEMORY_HISTORY directory (prismllm.comm.memhistory)
        self.pid = os.getpid()
        self.done = False

    def __call__(self) -> None:
        if self.done or self.rec is None or os.getpid() != self.pid:
            return
        self.done = True
        try:
            from prismllm.comm.install import collect
            from prismllm.trace.ranklog import write_ranklog

            saving = sys.modules.get("prismllm.comm.saving")
            if saving is not None:
                saving.close()
            self.rec.finish()
            log = collect(self.rec)
            if self.spool:
                os.makedirs(self.spool, exist_ok=True)
                write_ranklog(self.spool, log)
            if self.history:
                from prismllm.comm import memhistory

                memhistory.dump(self.history, self.rec.rank)
        except Exception:  # never mask the program's own outcome
            print("prism: could not write the rank log:", file=sys.stderr)
            traceback.print_exc()


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
    from prismllm.errors import PrismError

    if isinstance(e, PrismError):
        return e
    if isinstance(e.__cause__, PrismError):
        return e.__cause__
    gen = sys.modules.get("prismllm.generate.errors")
    last = gen.last_error() if gen is not None else None
    if last is not None and str(last) in str(e):
        return last
    return None


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
    if os.environ.get("PRISM_MODE"):
        from prismllm.comm.install import install
        from prismllm.errors import PrismError

        try:
            rec = install(os.environ["PRISM_MODE"])
        except (PrismError, ValueError) as e:
            print(f"prism: error: {e}", file=sys.stderr)
            raise SystemExit(3) from None
    from prismllm.status import reporter

    status = reporter()  # the launcher's hang diagnosis: where this rank stands, on request
    if status is not None and rec is not None:
        status.add(rec.status_lines, rec.progress)
    history = os.environ.get("PRISM_MEMORY_HISTORY") if rec is not None else None
    if history:
        from prismllm.comm import memhistory

        if not memhistory.start(int(os.environ.get("LOCAL_RANK", "0"))):
            history = None
    flush = _Flusher(rec, os.environ.get("PRISM_SPOOL"), history)
    atexit.register(flush)

    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        flush()
        raise
    except BaseException as e:  # the program's own error: same report, same exit status
        flush()
        perr = _prism_error(e)
        if perr is not None:  # prism's own error (e.g. the tensor generator): one line
            print(f"prism: error: {perr}", file=sys.stderr)
            sys.stderr.flush()
            raise SystemExit(3) from None
        tb = _program_traceback(e.__traceback__, script)
        e.__traceback__ = tb
        sys.excepthook(type(e), e, tb)
        sys.stderr.flush()
        raise SystemExit(1) from None
    flush()


if __name__ == "__main__":
    main()
