"""The rendezvous gate of multi-host runs (prismllm.launch.gate): a store behind it serves only
connections that prove the shared token; a tunnel on loopback proves it for local clients."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest

from prismllm.errors import PrismError
from prismllm.launch.gate import MAGIC, StoreGate, StoreTunnel, load_token
from prismllm.launch.launcher import host_store

TOKEN = b"a-token-of-at-least-sixteen-bytes"


@pytest.fixture
def gated():
    """A store on loopback behind a gate on 127.0.0.1; the gate's log lines."""
    store = host_store("127.0.0.1", 0)
    lines: list[str] = []
    gate = StoreGate("127.0.0.1", 0, store.port, TOKEN, lines.append)
    yield gate, lines
    gate.close()


def _client(port: int, seconds: float = 30):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=seconds))


def test_a_tunnel_with_the_token_reaches_the_store(gated):
    gate, lines = gated
    tunnel = StoreTunnel(("127.0.0.1", gate.port), TOKEN, lines.append, wait_s=10)
    try:
        a, b = _client(tunnel.port), _client(tunnel.port)
        a.set("k", "v")
        assert b.get("k") == b"v"
    finally:
        tunnel.close()
    assert gate.refused == 0 and not lines, lines


def test_a_client_without_the_token_is_served_nothing(gated):
    """torch's own store client, straight at the gate: closed at its first byte, nothing served."""
    gate, lines = gated
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistNetworkError / RuntimeError kinds
        _client(gate.port, seconds=2).set("k", "v")
    assert gate.refused >= 1
    assert any(
        "refused a connection to the rendezvous store from 127.0.0.1:" in ln and "no token" in ln for ln in lines
    )
    assert time.monotonic() - t0 < 30


def test_a_wrong_answer_or_silence_is_refused(gated):
    gate, lines = gated
    with socket.create_connection(("127.0.0.1", gate.port)) as s:
        s.sendall(MAGIC + os.urandom(32))
        s.recv(64)  # the gate's nonce and proof
        s.sendall(os.urandom(32))  # not the token's answer
        assert s.recv(1) == b""  # closed
    deadline = time.monotonic() + 5
    while not any("not this run's" in ln for ln in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("its token is not this run's" in ln for ln in lines), lines


def test_a_tunnel_with_another_token_is_refused(gated):
    gate, lines = gated
    mine: list[str] = []
    tunnel = StoreTunnel(("127.0.0.1", gate.port), b"another-token-sixteen-bytes-long", mine.append, wait_s=10)
    try:
        with pytest.raises(Exception):  # noqa: B017
            _client(tunnel.port, seconds=2).set("k", "v")
    finally:
        tunnel.close()
    assert any("refused this host: its gate does not hold this run's token" in ln for ln in mine), mine


def test_the_token_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PRISM_RDZV_TOKEN", raising=False)
    with pytest.raises(PrismError, match=r"needs a shared token.*--rdzv-token-file TOKEN or \$PRISM_RDZV_TOKEN"):
        load_token(None)
    monkeypatch.setenv("PRISM_RDZV_TOKEN", "short")
    with pytest.raises(PrismError, match="at least 16"):
        load_token(None)
    monkeypatch.setenv("PRISM_RDZV_TOKEN", TOKEN.decode())
    assert load_token(None) == TOKEN
    f = tmp_path / "token"
    f.write_bytes(TOKEN + b"\n")
    f.chmod(0o644)
    with pytest.raises(PrismError, match=r"readable by others \(mode 644\); chmod 600"):
        load_token(f)
    f.chmod(0o600)
    assert load_token(f) == TOKEN
    with pytest.raises(PrismError, match="--rdzv-token-file .*missing"):
        load_token(tmp_path / "missing")
