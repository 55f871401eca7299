"""A TCP relay between a client and the API server double that can make its open connections go silent.

The network at the edge, not our code: :meth:`TcpProxy.freeze` makes every connection open now relay
nothing more in either direction while both sockets stay open (no FIN, no RST), what a client sees when
the API server's node dies or a NAT forgets the flow. Connections opened afterwards relay normally (a
new route), so only a client with a read timeout ever notices and reconnects.
"""
from __future__ import annotations

import socket
import threading
from types import TracebackType


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.frozen = False

    def close(self) -> None:
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self._upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.accepted = 0

    def __enter__(self) -> "TcpProxy":
        self._spawn(self._accept)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def retarget(self, upstream_port: int) -> None:
        """New connections go to another server from now on (a failover behind one address)."""
        self._upstream = (self._upstream[0], upstream_port)

    def freeze(self) -> None:
        """Every connection open now goes silent for good (its sockets stay open)."""
        with self._lock:
            for c in self._conns:
                c.frozen = True

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for c in self._conns:
                c.close()
        for t in self._threads:
            t.join(timeout=5)

    def _spawn(self, target, *args) -> None:  # type: ignore[no-untyped-def]
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            conn = _Conn(client, upstream)
            with self._lock:
                self._conns.append(conn)
                self.accepted += 1
            self._spawn(self._pump, conn, client, upstream)
            self._spawn(self._pump, conn, upstream, client)

    @staticmethod
    def _pump(conn: _Conn, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if conn.frozen:  # swallow everything, close nothing
                if not data:
                    return
                continue
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return
