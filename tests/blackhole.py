"""A loopback TCP proxy in front of a redis-server that a test can blackhole and heal.

:meth:`Blackhole.cut` stops forwarding both ways: connections stay open, bytes already sent
wait (in the proxy, as in a partitioned network's buffers), new connections are accepted
and get no answer; :meth:`Blackhole.heal` forwards again, what waited included (a command
sent during the cut reaches Redis then, as TCP retransmits it after a partition). The
worker and producers under test use :attr:`Blackhole.url`; the test itself talks to Redis
directly.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Self


class Blackhole:
    """A proxy to ``127.0.0.1:<target_port>`` on a free loopback port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.flowing = threading.Event()
        self.flowing.set()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> Self:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def cut(self) -> None:
        """Stop forwarding (both ways, every connection, new ones too)."""
        self.flowing.clear()

    def heal(self) -> None:
        """Forward again, what waited during the cut first."""
        self.flowing.set()

    def close(self) -> None:
        self._closed.set()
        self.flowing.set()
        with self._lock:
            for each in [self._listener, *self._sockets]:
                try:
                    each.close()
                except OSError:
                    pass

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.append(client)
        self.flowing.wait()  # a connection made during the cut reaches Redis after it
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets.append(upstream)
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        self._pump(upstream, client)

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.flowing.wait()
                if self._closed.is_set():
                    break
                target.sendall(data)
        except OSError:
            pass
        for each in (source, target):
            try:
                each.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
