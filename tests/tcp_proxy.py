"""A TCP proxy for fault tests: what a NAT or a load balancer between two hosts can
do to a connection while both ends live. Each connection to the proxy is forwarded
to the target; reset() ends every connection with a TCP reset on both sides (as a
middlebox that dropped the connection's state does), stall() stops forwarding
while the connections stay open (a peer gone silent), stall_on(pattern) does so
the moment the pattern passes towards the target (on open links, a message type:
b"kv_transfer" stalls as the first write begins), and rate_bytes_s slows what goes
through (so a test can act while a large KV write is on the way)."""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time

CHUNK = 64 * 2**10


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.ends = (client, server)
        self.out = {
            client: bytearray(),
            server: bytearray(),
        }  # bytes waiting to be written to that end

    def peer(self, s: socket.socket) -> socket.socket:
        return self.ends[1] if s is self.ends[0] else self.ends[0]


class Proxy:
    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", rate_bytes_s: float | None = None
    ):
        self.target = (target_host, target_port)
        self.rate_bytes_s = rate_bytes_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._pairs: dict[socket.socket, _Pair] = {}
        self._lock = threading.Lock()
        self._is_stalled = False
        self._stall_on: bytes | None = None
        self._seen = b""  # the tail of what went towards the target, for a pattern split in two
        self._is_stopped = False
        self._allowance = 0.0
        self._allowance_at = time.monotonic()
        self.num_connections = 0
        self.num_resets = 0
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    # ---- what a test does ------------------------------------------------------

    def reset(self) -> int:
        """Every connection through the proxy ends with a reset, on both sides; returns how many."""
        with self._lock:
            pairs = {id(p): p for p in self._pairs.values()}.values()
            for p in pairs:
                for s in p.ends:
                    self._drop(s, is_reset=True)
            self.num_resets += len(pairs)
            return len(pairs)

    def stall(self) -> None:
        """Forward nothing (connections stay open; what is sent piles up, then blocks)."""
        self._is_stalled = True

    def stall_on(self, pattern: bytes) -> None:
        """Stall once pattern is seen going to the target (what holds it is kept for resume())."""
        self._stall_on = pattern

    @property
    def is_stalled(self) -> bool:
        return self._is_stalled

    def resume(self) -> None:
        self._stall_on = None
        self._is_stalled = False

    def close(self) -> None:
        self._is_stopped = True
        self._thread.join(timeout=5)
        with self._lock:
            for s in list(self._pairs):
                self._drop(s, is_reset=True)
        self._listener.close()
        self._sel.close()

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the loop ----------------------------------------------------------------

    def _drop(self, s: socket.socket, is_reset: bool) -> None:
        if self._pairs.pop(s, None) is None:
            return
        try:
            self._sel.unregister(s)
        except (KeyError, ValueError):
            pass
        if is_reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        pair = _Pair(client, server)
        for s in pair.ends:
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pairs[s] = pair
            self._sel.register(s, selectors.EVENT_READ)
        self.num_connections += 1

    def _budget(self) -> int:
        if self.rate_bytes_s is None:
            return CHUNK
        now = time.monotonic()
        self._allowance = min(
            self._allowance + (now - self._allowance_at) * self.rate_bytes_s, CHUNK
        )
        self._allowance_at = now
        return int(self._allowance)

    def _run(self) -> None:
        while not self._is_stopped:
            events = self._sel.select(timeout=0.01)
            with self._lock:
                for key, _ in events:
                    s = key.fileobj
                    if s is self._listener:
                        self._accept()
                    elif s in self._pairs and not self._is_stalled:
                        self._read(s)
                if not self._is_stalled:
                    self._flush()

    def _read(self, s: socket.socket) -> None:
        pair = self._pairs[s]
        peer = pair.peer(s)
        if len(pair.out[peer]) >= 4 * CHUNK:
            return  # the other side is slow: let TCP push back
        budget = self._budget()
        if budget <= 0:
            return
        try:
            data = s.recv(min(budget, CHUNK))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # closed or reset by one end: the other end sees it reset too
            for end in pair.ends:
                self._drop(end, is_reset=True)
            return
        if self.rate_bytes_s is not None:
            self._allowance -= len(data)
        if self._stall_on and s is pair.ends[0]:
            window = self._seen + data
            if self._stall_on in window:
                self._is_stalled = True
            self._seen = window[-len(self._stall_on) :]
        pair.out[peer] += data

    def _flush(self) -> None:
        for s, pair in list(self._pairs.items()):
            buf = pair.out[s]
            if not buf or s not in self._pairs:
                continue
            try:
                n = s.send(buf)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                for end in pair.ends:
                    self._drop(end, is_reset=True)
                continue
            del buf[:n]
