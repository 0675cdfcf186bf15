"""The process contract: every setting a prism parent hands a child process, and how a child
reports its error back. Written and read here and nowhere else.

A parent builds a :class:`ChildEnv` and passes ``child.to_env()`` to the launcher (on top of
torchrun's variables, which are torch's contract: ``prismllm.launch.environment``); a child reads
``ChildEnv.current()``. Every variable is ``PRISM_<FIELD>`` in upper case; unset fields are not
written, so a child sees only what its parent set.

A child that stops with an error of prism's own (a bad rule, a call the emulation cannot
serve, an assistant that cannot play its part) writes a :class:`ChildError` as JSON to
``PRISM_ERROR_FILE`` (:func:`report_error`) before it exits; the launcher reads it back
(:func:`read_error`) and names it in its failure, so no parent searches a child's output for
a text prefix.

Settings a *user* may give (tuning knobs, switches) are listed in :data:`USER_SETTINGS` and
read with :func:`user_setting`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal, cast, get_args, get_type_hints

from prismllm.errors import PrismError
from prismllm.specs import format_ranks, parse_ranks

# the choices of the contract's fields, checked in one place (ChildEnv._check, from the annotations)
Mode = Literal["record", "solo", "switch", "emulate"]
Inputs = Literal["recorded", "generated"]
Timing = Literal["fast", "real"]
Backend = Literal["gloo", "nccl"]
HeadStart = Literal["overhead", "iteration"]  # the host's head start in GPU slices (comm.headstart); off: unset
MODES: tuple[str, ...] = get_args(Mode)
INPUTS: tuple[str, ...] = get_args(Inputs)
TIMINGS: tuple[str, ...] = get_args(Timing)
BACKENDS: tuple[str, ...] = get_args(Backend)
HEAD_STARTS: tuple[str, ...] = get_args(HeadStart)
# the command line's: "off" leaves ChildEnv.head_start unset; "auto" is head_start_for()'s choice
HEAD_START_CHOICES = ("auto", *HEAD_STARTS, "off")


@dataclasses.dataclass(frozen=True)
class ChildEnv:
    """What a child process is told, by field (variable ``PRISM_<FIELD>``)."""

    # ---- every rank process (``python -m prismllm.comm.bootstrap``)
    mode: Mode | None = None  # record | solo | switch | emulate; None: the program runs with nothing installed
    spool: str | None = None  # directory the rank writes its RankLog to at exit
    error_file: str | None = None  # where the child writes its ChildError (set by the launcher)
    memory_history: str | None = None  # directory for the CUDA allocator history (comm.memhistory)
    cuda_on_cpu: bool | None = None  # map the program's CUDA calls to the CPU (prismllm.devicemap)
    router_module: str | None = None  # the MoE router the mock router forces or observes (prismllm.routing)
    routing: str | None = None  # the routing it forces, as JSON (routing.contract); None: observe
    routing_observe: str | None = None  # where observed routing counts are written
    routing_topk: int | None = None  # top-k of the router, where its module does not say
    spin: str | None = None  # {label: ms} as JSON: spin at each span so labelled (comm.spin; prism whatif --spin)
    # ---- status reports (launch.status; set by the launcher)
    status_dir: str | None = None
    status_name: str | None = None
    # ---- record mode
    native: bool | None = None  # record through the native backend (None: the Python path)
    save_tensors: str | None = None  # selector of the collectives whose outputs are saved
    # ---- tensors: record writes them here; solo mode and the assistant read them
    tensor_store: str | None = None
    # ---- solo mode
    rules: str | None = None  # a Python file of generator rules
    solo_batch: tuple[int, ...] | None = None  # the ranks running at once (they share object-collective values)
    # ---- switch mode: the capture's coordinator (prismllm.comm.switch)
    switch_address: str | None = None  # its abstract Unix socket
    switch_token: str | None = None  # proves a connection is one of the run's ranks
    # ---- sandbox ranks (mode emulate) and assistants
    sandbox: tuple[int, ...] | None = None  # the ranks that run for real
    graph: str | None = None  # the graph the virtual ranks are replayed from
    check_tensors: str | None = None  # recorded outputs the sandbox's pruned calls are compared with
    check_out: str | None = None  # where the comparison is written
    head_start: HeadStart | None = None  # prism time's GPU slices: overhead | iteration (comm.headstart)
    # record natively and issue the pruned calls through the native lane (the launcher's reading of
    # the user's PRISM_NATIVE_LANE for its devices: native_lane_setting)
    native_lane_on: bool | None = None
    # read NCCL's device time of each asynchronous call (prism time's slices: their timed graph's
    # transfers), which holds the call's Work, and its tensors, until its device completes
    transfer_durations: bool | None = None
    # a CPU emulation with real timing in one invocation: the file where each sandbox rank shares the
    # host time it leaves out of its clock, which the assistant's clock leaves out too (comm.leftout)
    left_out_board: str | None = None
    # ---- assistants (``python -m prismllm.assistant``)
    inputs: Inputs | None = None  # virtual ranks' inputs: recorded | generated (the sandbox ranks read it too)
    replay_timing: Timing | None = None  # fast | real
    emulate_backend: Backend | None = None  # the small groups' backend: gloo | nccl
    assistants: int | None = None  # how many assistants share the pruned groups
    assistant_index: int | None = None  # which one this is
    replay_out: str | None = None  # where this assistant writes its replay of the virtual ranks
    timeout_s: float | None = None  # a small group's creation and calls

    # -----------------------------------------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """The variables of the fields that are set."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, bool):
                v = int(v)
            elif f.name in _RANK_LISTS:
                v = format_ranks(v)
            out[variable(f.name)] = str(v)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChildEnv:
        """Read the contract from ``environ`` (default: this process's); a value that does not
        parse raises PrismError naming the variable."""
        env = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(variable(f.name))
            if raw is None or raw == "":
                continue
            kw[f.name] = _parse(f.name, raw)
        child = cls(**kw)
        child._check()
        return child

    @classmethod
    def current(cls) -> ChildEnv:
        """This process's contract (read once)."""
        global _CURRENT
        if _CURRENT is None:
            _CURRENT = cls.from_env()
        return _CURRENT

    def _check(self) -> None:
        for name, allowed in _CHOICES.items():
            v = getattr(self, name)
            if v is not None and v not in allowed:
                raise PrismError(f"{variable(name)}={v!r}: expected one of {', '.join(allowed)}")


_CURRENT: ChildEnv | None = None
# field -> its choices: every field annotated with a Literal (optional or not)
_HINTS = get_type_hints(ChildEnv)
_CHOICES = {
    name: choices
    for name, hint in _HINTS.items()
    if (choices := tuple(a for arg in (hint, *get_args(hint)) for a in get_args(arg) if isinstance(a, str)))
}
# every field annotated bool (a "0" read back as a string would be true)
_BOOLS = tuple(name for name, hint in _HINTS.items() if bool in (hint, *get_args(hint)))
_RANK_LISTS = ("sandbox", "solo_batch")
_INTS = ("assistants", "assistant_index", "routing_topk")


def variable(field: str) -> str:
    """The environment variable of a ChildEnv field."""
    return f"PRISM_{field.upper()}"


def _parse(name: str, raw: str) -> Any:
    try:
        if name in _BOOLS:
            v = raw.strip().lower()
            if v not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ValueError("expected 0 or 1")
            return v in ("1", "true", "yes", "on")
        if name in _INTS:
            return int(raw)
        if name == "timeout_s":
            return float(raw)
        if name in _RANK_LISTS:
            return parse_ranks(raw)
    except ValueError as e:
        raise PrismError(f"{variable(name)}={raw!r}: {e}") from None
    return raw


# ---------------------------------------------------------------------------------------------
# A child's error, reported to its parent


@dataclasses.dataclass(frozen=True)
class ChildError:
    """Why a child stopped. ``kind``: ``prism`` (prism stopped the program: a message that
    names the rank, the call and the fix), ``assistant`` (an assistant cannot play its part),
    ``out_of_memory`` (the program's allocation failed; ``calls``: the communication calls the
    rank had made, where in the program it ran out) or ``storage`` (a write failed on a full disk
    or a failing file system: the path and the free space there, ``prismllm.outdir``)."""

    kind: str
    message: str
    calls: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def report_error(kind: str, message: str, path: str | None = None, calls: int | None = None) -> None:
    """Write the child's error where its parent reads it (``PRISM_ERROR_FILE``); nothing
    without one. Never raises: the child is on its way out."""
    path = path if path is not None else os.environ.get(variable("error_file"))
    if not path:
        return
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(ChildError(kind, message, calls).to_json())
        os.replace(tmp, path)
    except OSError:
        pass


def read_error(path: str | os.PathLike | None) -> ChildError | None:
    """The error a child reported at ``path``, or None."""
    if not path:
        return None
    try:
        with open(path) as f:
            d = json.load(f)
        calls = d.get("calls")
        return ChildError(str(d["kind"]), str(d["message"]), int(calls) if calls is not None else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# What a user may set

USER_SETTINGS: dict[str, str] = {
    "PRISM_DEBUG": "1: an error of a prism command prints its traceback after its one line (as prism --debug)",
    "PRISM_STATUS_AFTER": "seconds without progress before the launcher says where each process stands "
    "(default 300; 'off' never)",
    "PRISM_NATIVE": "record through the native backend (1) or the Python path (0) when `prism record` "
    "is not given --recorder",
    "PRISM_NATIVE_CACHE": "where the native recorder is built (default ~/.cache/prismllm/native)",
    "PRISM_NATIVE_BUILD_TIMEOUT": "seconds to wait for another process's build of the native recorder (default 600)",
    "PRISM_PROGRAM_CHECK": "'off' skips the check that a launch runs the graph's program",
    "PRISM_STAGE_AHEAD": "calls an assistant prepares ahead per pruned group (default 1)",
    "PRISM_IN_FLIGHT": "calls an assistant may have entered on a pruned group and not seen complete (default 16)",
    "PRISM_SOLO_OBJECT_WAIT": "seconds a solo rank waits for a peer of its batch to publish its part of an object "
    "collective (default 120)",
    "PRISM_ISSUE_THREAD": "1 (the default): a GPU sandbox plans and issues its asynchronous pruned calls on a thread "
    "of its own, off the program's (docs/internals/pruning.md); 0: on the program's thread; all: a CPU sandbox's too",
    "PRISM_DEVICE_POINTS": "1: an emulated GPU sandbox rank times every span of its rank log on the device, as a "
    "slice does (its compute per iteration in emulate.json; each point costs the device ~3 µs between two kernels, "
    "which the real run does not spend); default: only its iteration boundaries",
    "PRISM_NATIVE_LANE": "1: an emulated sandbox rank records natively and issues its pruned calls through the "
    "native lane, with no Python on the way once a call's signature was seen (docs/internals/pruning.md); "
    "0: the Python path; auto (the default): the lane on GPUs (NCCL), the Python path on the CPU (gloo)",
    "PRISM_RDZV_TOKEN": "the token every host of a multi-host emulation shares (`prism emulate --rdzv-endpoint`), "
    "where no --rdzv-token-file is given",
    "PRISM_HOST_COMPLETION": "'wait' makes the Python recorder read a CPU call's completion at its "
    "wait instead of from a callback",
}


def native_lane_setting(on_gpu: bool) -> bool:
    """``PRISM_NATIVE_LANE``: whether an emulated sandbox rank (a slice's too) runs the native lane,
    where its small groups are NCCL (``on_gpu``) or gloo. ``auto`` (the default): on GPUs, where
    the lane's sandbox peaks at the real rank's memory to the byte and its host time a call is a
    few microseconds (docs/benchmarks.md, the GPU suite); the Python path on the CPU, whose
    figures were measured through it."""
    setting = user_setting("PRISM_NATIVE_LANE", "auto")
    if setting not in ("auto", "0", "1"):
        raise PrismError(
            f"PRISM_NATIVE_LANE={setting!r}: auto (the default: the lane on GPUs), 0 (the Python path) or 1 "
            "(the native lane)"
        )
    return on_gpu if setting == "auto" else setting == "1"


def head_start_for(choice: str, native_lane: bool) -> HeadStart | None:
    """The head start of a GPU slice for the command line's ``--head-start`` (None: none).
    ``auto``: none where the slices run the native lane (its host time a call is a few
    microseconds, and the head start needs the Python recorder), ``overhead`` where they run the
    Python path, whose host time a call the head start keeps off the device's timeline
    (docs/benchmarks.md, the GPU suite: the lane without a head start predicts near host-bound
    TP jobs best)."""
    if choice not in HEAD_START_CHOICES:
        raise PrismError(f"--head-start {choice!r}: expected one of {', '.join(HEAD_START_CHOICES)}")
    if choice == "auto":
        return None if native_lane else "overhead"
    return None if choice == "off" else cast(HeadStart, choice)


def user_setting(name: str, default: str = "") -> str:
    """A user setting's value (``default`` when unset or empty); ``name`` must be listed in
    :data:`USER_SETTINGS`."""
    if name not in USER_SETTINGS:
        raise KeyError(f"{name} is not a prism user setting")
    v = os.environ.get(name, "")
    return v if v.strip() else default


__all__ = ["ChildEnv", "ChildError", "USER_SETTINGS", "read_error", "report_error", "user_setting", "variable"]
