"""A TCP delay proxy: another host's distance on loopback, where the kernel has no `tc netem`.

`DelayProxy(upstream, one_way_s)` listens on a loopback port and forwards every connection to
`upstream` (`(host, port)` or a unix socket path), holding each chunk read `one_way_s` before
writing it on, in each direction: a round trip through it takes 2 x `one_way_s` more. A reader
thread per direction stamps each chunk with its due time and queues it; a writer thread per
direction sends the chunks in the order they came, each once it is due, so bytes keep their order
and a burst of chunks is delayed once, not once per chunk. The delay can be changed while it
runs (`proxy.one_way_s = ...`); chunks already queued keep theirs. Same threads at 0 delay, so
0 ms costs the same hop as 2 ms does.

It also counts exchanges: per connection, a client write that follows an answer from the server
(or is the connection's first) starts one. Commands sent together (a pipeline, a MULTI/EXEC, a
script) are one exchange; a client waiting on each answer before its next command makes one per
command. Exchanges on different connections of one process may overlap, so the count over all
connections is an upper bound on the sequential round trips.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable


class DelayProxy:
    def __init__(self, upstream: tuple[str, int] | str, one_way_s: float = 0.0) -> None:
        self.upstream = upstream
        self.one_way_s = one_way_s
        self.exchanges = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        self._closed = True
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _connect(self) -> socket.socket:
        if isinstance(self.upstream, str):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(self.upstream)
            return server
        server = socket.create_connection(self.upstream)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return server

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._join(client)

    def _join(self, client: socket.socket) -> None:
        """Forward one client's connection, counting its exchanges."""
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server = self._connect()
        self._sockets += [client, server]
        answered = True  # the server has answered since the client last wrote

        def client_wrote() -> None:
            nonlocal answered
            if answered:
                answered = False
                with self._lock:
                    self.exchanges += 1

        def server_answered() -> None:
            nonlocal answered
            answered = True

        self._pump(client, server, client_wrote)
        self._pump(server, client, server_answered)

    def _pump(self, source: socket.socket, sink: socket.socket, on_read: Callable[[], None]) -> None:
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            while True:
                try:
                    data = source.recv(1 << 16)
                except OSError:
                    data = b""
                if data:
                    on_read()
                chunks.put((time.monotonic() + self.one_way_s, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = chunks.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                try:
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()
