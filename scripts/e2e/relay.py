"""TCP between network namespaces over their loopbacks, in threads of the harness.

The real node (:mod:`node`) has a network namespace of its own: its loopback is not the host's.
A :class:`Relay` listens on an address of one namespace and connects each accepted connection
to an address of another, copying bytes both ways (TLS passes through untouched: a client
verifies the far server's certificate). A socket belongs to the network namespace of the
thread that made it, so each socket of a namespace is made by a short thread that first
joins it (``setns``); the copying runs in ordinary threads. Nothing runs outside the harness:
its relays end with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

CLONE_NEWNET = 0x40000000
#: (network namespace file or None for the harness's own, host, port); a host that is a path
#: is a unix socket (connect only).
Address = tuple[str | None, str, int]
T = TypeVar("T")


def in_netns(netns: str | None, make: Callable[[], T]) -> T:
    """``make()`` run by a thread that joined ``netns`` (None: here)."""
    if netns is None:
        return make()
    result: list[T] = []
    errors: list[Exception] = []

    def target() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns}")
            finally:
                os.close(fd)
            result.append(make())
        except Exception as error:  # noqa: BLE001 (handed to the caller, raised there)
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class Relay:
    """Listens on ``listen``, relays each connection to ``connect`` (see the module doc)."""

    def __init__(self, listen: Address, connect: Address) -> None:
        self.connect = connect
        netns, host, port = listen
        self.server = in_netns(netns, lambda: socket.create_server((host, port)))
        self.port = int(self.server.getsockname()[1])
        self._open: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        netns, host, port = self.connect
        family = socket.AF_UNIX if host.startswith("/") else socket.AF_INET
        try:
            upstream = in_netns(
                netns, lambda: socket.socket(family, socket.SOCK_STREAM)
            )
            upstream.connect(host if family == socket.AF_UNIX else (host, port))
        except OSError:
            client.close()
            return
        self._open |= {client, upstream}
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        for s in (client, upstream):
            self._open.discard(s)
            s.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.server.close()
        for s in list(self._open):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
