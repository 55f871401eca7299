"""TLS for the extender's endpoint: a server context that asks for a client certificate, and live reload.

kube-scheduler's extender config has ``tlsConfig`` (``certFile``, ``keyFile``, ``caFile``): it checks
our serving certificate against ``caFile`` and presents its own client certificate. We ask for a
client certificate but do not *require* it at the handshake (``CERT_OPTIONAL``): a client that presents
one must present one signed by ``--client-ca`` or the handshake fails, and a client that presents none
still completes it, so the kubelet's HTTPS probes (which never send one) can reach /healthz and /readyz.
Every other route checks :attr:`ssl.SSLSocket.getpeercert` per connection (extender.http_server).

Rotation: a Secret volume is updated in place (an atomic ``..data`` symlink swap), so
:class:`Reloader` re-reads the three files when their modification times change and hands out a new
context for new connections; connections already open keep the old one until they close.
"""
from __future__ import annotations

import os
import ssl
from typing import Callable
from dataclasses import dataclass

from vramshare import logs

__all__ = ["TlsFiles", "server_context", "Reloader"]

log = logs.get("vramshare.extender.tls")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the serving certificate chain and key, and the CA that signs trusted clients."""

    cert: str
    key: str
    client_ca: str

    def stamp(self) -> tuple[float, ...]:
        """Modification times (following symlinks, as a Secret volume's ``..data`` swap needs)."""
        return tuple(os.stat(p).st_mtime for p in (self.cert, self.key, self.client_ca))


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """TLS 1.2+ server context asking for (not requiring) a client certificate signed by the client CA.

    Raises ``OSError``/``ssl.SSLError`` naming the file when one is missing or not PEM.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert, files.key)
    ctx.load_verify_locations(cafile=files.client_ca)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    # No session tickets: a resumed session must not outlive a CA rotation on our side.
    ctx.options |= ssl.OP_NO_TICKET
    return ctx


class Reloader:
    """Hand out the current context; rebuild it when the files change, keep the last good one otherwise."""

    def __init__(self, files: TlsFiles, on_result: Callable[[str], None] | None = None) -> None:
        self.files = files
        self._stamp = files.stamp()
        self.context = server_context(files)
        self.on_result = on_result  # "reloaded" / "refused": vramshare_extender_tls_reloads_total

    def check(self) -> bool:
        """Reload when a file changed; True when a new context is in force. Never raises."""
        try:
            stamp = self.files.stamp()
            if stamp == self._stamp:
                return False
            context = server_context(self.files)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("tls files changed but do not load; keeping the previous certificates",
                        cert=self.files.cert, error=str(exc))
            if self.on_result is not None:
                self.on_result("refused")
            return False
        self._stamp, self.context = stamp, context
        if self.on_result is not None:
            self.on_result("reloaded")
        log.info("tls certificates reloaded", cert=self.files.cert, client_ca=self.files.client_ca)
        return True
