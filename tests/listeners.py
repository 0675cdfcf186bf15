"""What a process tree listens on, seen from /proc as `ss -ltnp` sees it: a thread samples the
tree every 0.1 s while a stage runs, and keeps every listening TCP socket it saw (address, port,
the process's name). Tests assert that a stage listens on loopback alone (issue 37)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
from pathlib import Path


def _tree(root: int) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    seen, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(children.get(p, []))
    return seen


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
    except OSError:
        pass
    return out


def _address(hexaddr: str) -> str:
    if len(hexaddr) == 8:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hexaddr, 16)))
    words = [struct.pack("<I", int(hexaddr[i : i + 8], 16)) for i in range(0, 32, 8)]
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))


def listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (address, port)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] == "0A":  # LISTEN
                addr, port = f[1].split(":")
                out[int(f[9])] = (_address(addr), int(port, 16))
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class ListenerWatch:
    """``with ListenerWatch(pid) as w: ...`` then ``w.seen``: {(address, port, process name)}."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.seen: set[tuple[str, int, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        socks = listening()
        for pid in _tree(self.root):
            mine = _socket_inodes(pid) & socks.keys()
            if not mine:
                continue
            try:
                name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                name = str(pid)
            self.seen.update((*socks[i], name) for i in mine)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def __enter__(self) -> ListenerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def outside_loopback(self) -> list[tuple[str, int, str]]:
        return sorted(s for s in self.seen if not is_loopback(s[0]))
