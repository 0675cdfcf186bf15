"""The program fingerprint of a graph, and the check that a launch runs that program.

A graph describes one program with one argument list at one world size. Replaying it under
another program (another ``--tp``, another model size, an edited script) gives numbers that
mean nothing, or a deviation error deep inside the run; ``prism emulate`` and ``prism time``
therefore refuse such a launch at the start, with one message that names the first difference
and says what to do.

``prism record`` and ``prism capture`` write the fingerprint into the manifest as
``program`` (:func:`program_fingerprint`, taken *before* the ranks run, so that files the
program writes are not mistaken for its inputs)::

    "program": {"script": "examples/gpt3d.py",      # as launched
                "name": "gpt3d.py",
                "sha256": "<the script file's bytes>",
                "args": ["--tp", "2", ...],
                "files": {"7": {"sha256": ..., "bytes": ...}}}   # args naming existing files

``prism time`` and ``prism calibrate`` keep the manifest's ``program`` and ``command`` in the
graphs they write, so a timed or calibrated graph is checked like its bare graph.

Rules (:func:`check_program`):

- the script's content must be the graph's (same SHA-256) when both are known: another path
  to the same bytes is fine, an edited script is not;
- the argument lists must be equal, position by position, except for arguments that name
  files: a value that named an existing file when the graph was made (an input: a config, a
  data file) may be another path to the same bytes (files over 64 MiB: the same size); a value
  that named no existing file then and looks like a path is an output (``--json-log``,
  ``--save-params``): such a flag may be given with any path, or left out, or added;
- the world size is always the graph's (the launcher runs the graph's N);
- a graph without ``program`` (written before it existed) is compared by the arguments of its
  ``command`` only; a graph with neither is not checked.

``PRISM_PROGRAM_CHECK=off`` in the environment skips the check, for a deliberate variant of
the graph's program (e.g. a wrapper that imports it and injects a fault).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from prismllm.childenv import user_setting
from prismllm.errors import PrismError
from prismllm.fsutil import sha256_file

HASH_LIMIT = 64 << 20  # argument files larger than this are compared by size only
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_PATHLIKE = re.compile(r"\S*\.[A-Za-z][A-Za-z0-9]{0,7}")
ENV_SWITCH = "PRISM_PROGRAM_CHECK"


def _is_flag(tok: str) -> bool:
    return tok.startswith("-") and len(tok) > 1 and not _NUMBER.fullmatch(tok)


def _value(tok: str) -> tuple[str | None, str]:
    """(flag, value) of ``--flag=value``; (None, tok) for a plain value."""
    if _is_flag(tok):
        flag, sep, value = tok.partition("=")
        return (flag, value) if sep else (tok, "")
    return None, tok


def _file_info(value: str) -> dict[str, Any] | None:
    if not value or _NUMBER.fullmatch(value):
        return None
    try:
        if os.path.isfile(value):
            size = os.path.getsize(value)
            info: dict[str, Any] = {"bytes": int(size)}
            if size <= HASH_LIMIT:
                info["sha256"] = sha256_file(value)
            return info
        if os.path.isdir(value):
            return {"dir": True}
    except OSError:
        return None
    return None


def program_fingerprint(script: str | os.PathLike, args: Sequence[str]) -> dict[str, Any]:
    """The manifest's ``program`` entry for SCRIPT ARGS, read now: call it before the program
    runs (files it writes would otherwise be taken for inputs)."""
    script = str(script)
    args = [str(a) for a in args]
    files: dict[str, Any] = {}
    for i, tok in enumerate(args):
        flag, value = _value(tok)
        if flag is not None and not value:
            continue
        info = _file_info(value)
        if info is not None:
            files[str(i)] = info
    return {
        "script": script,
        "name": os.path.basename(script),
        "sha256": sha256_file(script) if os.path.isfile(script) else None,
        "args": args,
        "files": files,
    }


def _pathlike(value: str) -> bool:
    return (
        bool(value)
        and not _NUMBER.fullmatch(value)
        and ("/" in value or os.sep in value or bool(_PATHLIKE.fullmatch(value)))
    )


def _describe(args: Sequence[str], i: int) -> str | None:
    """The argument at position ``i`` with its flag or value: ``--tp 2``."""
    if i >= len(args):
        return None
    tok = args[i]
    if _is_flag(tok):
        if "=" not in tok and i + 1 < len(args) and not _is_flag(args[i + 1]):
            return f"{tok} {args[i + 1]}"
        return tok
    if i > 0 and _is_flag(args[i - 1]) and "=" not in args[i - 1]:
        return f"{args[i - 1]} {tok}"
    return f"argument {i + 1} {shlex.quote(tok)}"


def _value_differs(i: int, a: str, b: str, files: dict[str, Any]) -> str | None:
    """None when ``b`` may stand where the graph had ``a`` (another path to the same input
    file, or another output path); else why not ("" when the values simply differ)."""
    fa, va = _value(a)
    fb, vb = _value(b)
    if fa != fb or (fa is not None and not va):
        return ""
    info = files.get(str(i))
    if isinstance(info, dict) and ("sha256" in info or "bytes" in info):
        if not os.path.isfile(vb):
            return None  # absent now: an output path, or the program will miss it itself
        if "sha256" in info and os.path.getsize(vb) <= HASH_LIMIT:
            return None if sha256_file(vb) == info["sha256"] else "whose content differs"
        return None if os.path.getsize(vb) == info.get("bytes") else "whose size differs"
    if isinstance(info, dict) and info.get("dir"):
        return None  # an input directory: its contents are not compared
    if _pathlike(va) and _pathlike(vb):
        return None  # an output path (named nothing when the graph was made)
    return ""


def _output_flags(ga: Sequence[str], files: dict[str, Any]) -> set[str]:
    """Flags of the graph's arguments whose value named no existing file when the graph was
    made and looks like a path: outputs (``--json-log out.json``)."""
    out = set()
    for i, tok in enumerate(ga):
        flag, value = _value(tok)
        if flag is None:
            continue
        j = i
        if not value and i + 1 < len(ga) and not _is_flag(ga[i + 1]):
            value, j = ga[i + 1], i + 1
        if value and _pathlike(value) and str(j) not in files:
            out.add(flag)
    return out


def _without_outputs(args: Sequence[str], drop: Callable[[str, str], bool]) -> list[tuple[int, str]]:
    """(position, argument) of ``args`` less the output flags ``drop(flag, value)`` names:
    present or absent, another path or the same, an output does not change the program."""
    kept, i = [], 0
    while i < len(args):
        flag, value = _value(args[i])
        if flag is not None and not value and i + 1 < len(args) and not _is_flag(args[i + 1]):
            if drop(flag, args[i + 1]):
                i += 2
                continue
        elif flag is not None and value and drop(flag, value):
            i += 1
            continue
        kept.append((i, args[i]))
        i += 1
    return kept


def _first_difference(ga: Sequence[str], la: Sequence[str], files: dict[str, Any]) -> tuple[int, int, str] | None:
    """(position in the graph's args, position in the launched args, why) of the first
    difference, or None."""
    outputs = _output_flags(ga, files)
    graph_flags = {f for f, _ in map(_value, ga) if f is not None}
    a_kept = _without_outputs(ga, lambda f, v: f in outputs)
    b_kept = _without_outputs(
        la, lambda f, v: f in outputs or (f not in graph_flags and _pathlike(v) and not os.path.exists(v))
    )
    for k in range(max(len(a_kept), len(b_kept))):
        ia, a = a_kept[k] if k < len(a_kept) else (len(ga), None)
        ib, b = b_kept[k] if k < len(b_kept) else (len(la), None)
        if a == b:
            continue
        if a is None or b is None:
            return ia, ib, ""
        why = _value_differs(ia, a, b, files)
        if why is not None:
            return ia, ib, why
    return None


def _switch_off() -> bool:
    return user_setting(ENV_SWITCH).strip().lower() in ("0", "off", "no", "false")


def check_program(manifest: dict, script: str, args: Sequence[str], world_size: int) -> None:
    """Refuse (PrismError, one message) to launch SCRIPT ARGS on a graph made from another
    program or argument list; ``world_size`` is the graph's (the launch runs its N ranks).
    See the module's docstring for the rules."""
    if not isinstance(manifest, dict) or _switch_off():
        return
    program = manifest.get("program")
    command = manifest.get("command")
    if isinstance(program, dict) and isinstance(program.get("args"), list):
        g_script = str(program.get("script") or program.get("name") or "the script")
        g_sha = program.get("sha256")
        g_args = [str(a) for a in program["args"]]
        files = program.get("files") if isinstance(program.get("files"), dict) else {}
    elif isinstance(command, list) and command:
        g_script, g_sha, g_args, files = str(command[0]), None, [str(a) for a in command[1:]], {}
    else:
        return
    script = str(script)
    args = [str(a) for a in args]
    verb = "recorded" if manifest.get("mode") == "record" else "captured"
    made = "record" if manifest.get("mode") == "record" else "capture"
    graph_cmd = shlex.join([g_script, *g_args])
    what = (
        f"launch the graph's own command (`-- {graph_cmd}`), or {made} a new graph of this one "
        f"(`prism {made}{' --mode solo' if made == 'capture' else ''} "
        f"{'--world' if made == 'capture' else '--nproc'} {world_size} ... -- {shlex.join([script, *args])}`)"
        + (", then `prism time` and `prism calibrate` it" if manifest.get("mode") in ("timed", "calibrated") else "")
        + f"; {ENV_SWITCH}=off runs a deliberate variant anyway"
    )

    if isinstance(g_sha, str) and os.path.isfile(script):
        sha = sha256_file(script)
        if sha != g_sha:
            if os.path.basename(script) == os.path.basename(g_script):
                now = f"but {script} is not that file any more (sha256 {sha[:12]}, the graph's {g_sha[:12]})"
            else:
                now = f"but you launched {script}, whose content differs (sha256 {sha[:12]}, the graph's {g_sha[:12]})"
            raise PrismError(f"the graph was {verb} from {g_script} {now}: {what}")

    diff = _first_difference(g_args, args, files)
    if diff is None:
        return
    i, j, why = diff
    theirs, ours = _describe(g_args, i), _describe(args, j)
    if why:
        detail = f"with {theirs} but you launched {ours}, {why}"
    elif theirs is not None and theirs not in _items(args) and (ours is None or ours in _items(g_args)):
        detail = f"with {theirs} but you launched it without {theirs}"
    elif ours is not None and ours not in _items(g_args) and (theirs is None or theirs in _items(args)):
        detail = f"without {ours} but you launched {ours}"
    else:
        detail = f"with {theirs} but you launched {ours}"
        if sorted(g_args) == sorted(args):
            detail += " (the same arguments in another order)"
    raise PrismError(f"the graph was {verb} from {g_script} {detail}: {what}")


def _items(args: Sequence[str]) -> set[str]:
    """Every argument as :func:`_describe` names it."""
    return {_describe(args, i) for i in range(len(args))}


__all__ = ["check_program", "program_fingerprint", "sha256_file"]
