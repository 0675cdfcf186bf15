"""The rendezvous store's gate for multi-host runs: nothing is served to a connection before it
proves it holds the run's shared token.

torch's TCPStore has no authentication: whoever reaches its port reads and writes every key (and
so can join, stall or steer the run). A single-host run keeps it on loopback
(``launcher.host_store``). A multi-host run (``prism emulate --rdzv-endpoint``) must be reachable
from the other hosts; there the store itself stays on loopback and :class:`StoreGate` listens on
the endpoint. Each connection first completes a challenge-response on the token, then its bytes
are relayed to the store unchanged. On the other hosts :class:`StoreTunnel` listens on loopback for
the local processes (they connect to it as to the store) and answers the challenge for each of
their connections.

The handshake (HMAC-SHA256, so the token never crosses the wire; fresh nonces on both sides, so
an answer overheard once is worth nothing later):

    client -> gate:   MAGIC, nonce_c (32 bytes)
    gate   -> client: nonce_s (32 bytes), HMAC(token, "gate" + nonce_c + nonce_s)
    client -> gate:   HMAC(token, "client" + nonce_s + nonce_c)

A client that sends anything but MAGIC first (torch's own store client, a port scanner) is
closed at its first differing byte; one that does not finish within HANDSHAKE_S seconds, or whose
answer is wrong, is closed too. Each refusal is one line through ``log``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prismllm.childenv import user_setting
from prismllm.errors import PrismError

MAGIC = b"PRISM-GATE/1\n"
NONCE = 32
HANDSHAKE_S = 10.0
MIN_TOKEN_BYTES = 16
TOKEN_VARIABLE = "PRISM_RDZV_TOKEN"
MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_hex(32))' > TOKEN && chmod 600 TOKEN"


def load_token(token_file: str | os.PathLike | None) -> bytes:
    """The run's shared token: the contents of ``token_file`` (stripped), else $PRISM_RDZV_TOKEN.
    Never from the command line (others see it in the process list). A file that others may read
    is refused, as ssh refuses such a key."""
    if token_file is not None:
        path = Path(token_file)
        try:
            mode = path.stat().st_mode
            text = path.read_bytes().strip()
        except OSError as e:
            raise PrismError(f"--rdzv-token-file {path}: {e.strerror or e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PrismError(f"--rdzv-token-file {path}: readable by others (mode {mode & 0o777:o}); chmod 600 {path}")
        where = f"--rdzv-token-file {path}"
    else:
        text = user_setting(TOKEN_VARIABLE).strip().encode()
        where = TOKEN_VARIABLE
        if not text:
            raise PrismError(
                f"a multi-host run (--rdzv-endpoint) needs a shared token, the same on every host: "
                f"--rdzv-token-file TOKEN or ${TOKEN_VARIABLE}; make one with: {MAKE_TOKEN}"
            )
    if len(text) < MIN_TOKEN_BYTES:
        raise PrismError(f"{where}: a token of {len(text)} byte(s); use at least {MIN_TOKEN_BYTES}: {MAKE_TOKEN}")
    return text


def _proof(token: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, side + first + second, hashlib.sha256).digest()


class _Refused(Exception):
    pass


def _recv_exact(sock: socket.socket, n: int, deadline: float, expect: bytes | None = None) -> bytes:
    """``n`` bytes from ``sock`` before ``deadline`` (time.monotonic); with ``expect``, refused at
    the first byte that differs from it."""
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Refused(f"no answer to the challenge within {HANDSHAKE_S:g} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            continue
        if not chunk:
            raise _Refused("it closed the connection during the challenge")
        data += chunk
        if expect is not None and not expect.startswith(data):
            raise _Refused("it did not ask for the gate (no token)")
    sock.settimeout(None)
    return data


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` and ``b`` until either side closes; then close both."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    other = threading.Thread(target=pump, args=(b, a), daemon=True, name="prism-gate-relay")
    other.start()
    pump(a, b)
    other.join()
    a.close()
    b.close()


class _Listener:
    """A listening socket whose connections are each handled on a thread of their own, all of
    them closed by :meth:`close`."""

    def __init__(self, addr: str, port: int, handle: Callable[[socket.socket, str], None], what: str) -> None:
        try:
            family, _, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(where)
            self.sock.listen(512)
        except OSError as e:
            raise PrismError(f"cannot listen for {what} on {addr}:{port}: {e.strerror or e}") from None
        self.port: int = self.sock.getsockname()[1]
        self._handle = handle
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"prism-{what}").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._open.add(conn)
            who = f"{peer[0]}:{peer[1]}"
            threading.Thread(target=self._serve, args=(conn, who), daemon=True).start()

    def _serve(self, conn: socket.socket, who: str) -> None:
        try:
            self._handle(conn, who)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def track(self, s: socket.socket) -> None:
        with self._lock:
            self._open.add(s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._open)
        for s in (self.sock, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class StoreGate:
    """Listens on ``addr:port`` (the run's endpoint) and relays each connection that proves the
    token to the store on 127.0.0.1:``store_port``; refusals are reported through ``log``."""

    def __init__(self, addr: str, port: int, store_port: int, token: bytes, log: Callable[[str], None]) -> None:
        self.store_port, self.token, self.log = store_port, token, log
        self.refused = 0
        self.listener = _Listener(addr, port, self._handle, "the rendezvous gate")
        self.port = self.listener.port

    def _handle(self, conn: socket.socket, who: str) -> None:
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            _recv_exact(conn, len(MAGIC), deadline, expect=MAGIC)
            nonce_c = _recv_exact(conn, NONCE, deadline)
            nonce_s = secrets.token_bytes(NONCE)
            conn.sendall(nonce_s + _proof(self.token, b"gate", nonce_c, nonce_s))
            answer = _recv_exact(conn, hashlib.sha256().digest_size, deadline)
            if not hmac.compare_digest(answer, _proof(self.token, b"client", nonce_s, nonce_c)):
                raise _Refused("its token is not this run's")
        except (_Refused, OSError) as e:
            self.refused += 1
            self.log(f"refused a connection to the rendezvous store from {who}: {e}")
            return
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port))
        except OSError as e:
            self.log(f"the rendezvous store on 127.0.0.1:{self.store_port} did not answer: {e}")
            return
        self.listener.track(store)
        _relay(conn, store)

    def close(self) -> None:
        self.listener.close()


class StoreTunnel:
    """Listens on 127.0.0.1 (``port``) for this host's processes and carries each of their
    connections to the gate at ``remote``, answering its challenge with ``token``. The remote
    side may come up later than the local processes: each connection retries until ``wait_s``."""

    def __init__(self, remote: tuple[str, int], token: bytes, log: Callable[[str], None], wait_s: float) -> None:
        self.remote, self.token, self.log, self.wait_s = remote, token, log, wait_s
        self._warned = False
        self.listener = _Listener("127.0.0.1", 0, self._handle, "the rendezvous tunnel")
        self.port = self.listener.port

    def _connect(self) -> socket.socket | None:
        host, port = self.remote
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                s = socket.create_connection((host, port), timeout=HANDSHAKE_S)
            except OSError:
                if time.monotonic() > deadline:
                    self.log(f"the rendezvous endpoint {host}:{port} did not answer in {self.wait_s:g} s")
                    return None
                time.sleep(0.2)
                continue
            try:
                deadline_h = time.monotonic() + HANDSHAKE_S
                nonce_c = secrets.token_bytes(NONCE)
                s.sendall(MAGIC + nonce_c)
                got = _recv_exact(s, NONCE + hashlib.sha256().digest_size, deadline_h)
                nonce_s, proof = got[:NONCE], got[NONCE:]
                if not hmac.compare_digest(proof, _proof(self.token, b"gate", nonce_c, nonce_s)):
                    raise _Refused("its gate does not hold this run's token")
                s.sendall(_proof(self.token, b"client", nonce_s, nonce_c))
            except (_Refused, OSError) as e:
                s.close()
                if not self._warned:
                    self._warned = True
                    what = e if isinstance(e, _Refused) else "it closed the connection: a different token?"
                    self.log(f"the rendezvous endpoint {host}:{port} refused this host: {what}")
                return None
            return s

    def _handle(self, conn: socket.socket, who: str) -> None:
        remote = self._connect()
        if remote is None:
            return
        self.listener.track(remote)
        _relay(conn, remote)

    def close(self) -> None:
        self.listener.close()
