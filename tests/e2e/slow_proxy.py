"""A TCP proxy on loopback that can hold every byte for a while: a slow network or an overloaded server,
as a client sees it."""

from __future__ import annotations

import socket
import threading
import time


class SlowProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; ``delay_s`` (changeable at any time) holds each chunk."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.delay_s = target, 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
