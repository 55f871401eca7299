"""TLS for the extender's endpoint: a server context that asks for a client certificate, and live reload.

kube-scheduler's extender config has ``tlsConfig`` (``certFile``, ``keyFile``, ``caFile``): it checks
our serving certificate against ``caFile`` and presents its own client certificate. We ask for a
client certificate but do not *require* it at the handshake (``CERT_OPTIONAL``): a client that presents
one must present one signed by ``--client-ca`` or the handshake fails, and a client that presents none
still completes it, so the kubelet's HTTPS probes (which never send one) can reach /healthz and /readyz.
Every other route checks :attr:`ssl.SSLSocket.getpeercert` per connection (extender.http_server).

Rotation: a Secret volume is updated in place (an atomic ``..data`` symlink swap), so
:class:`Reloader` re-reads the three files when their *content* changes (a digest, not the mtime:
``cp -p`` and tar keep mtimes) and hands out a new context for new connections. A connection
authenticated under a client CA that the new files no longer hold is closed by the server
(:meth:`Reloader.still_trusted`, checked at each reload), so a removed CA stops being served within
the server's TLS check interval.

Client certificates must carry the ``clientAuth`` extended key usage (:meth:`ClientCertificate.read`):
OpenSSL accepts a certificate without any EKU for any purpose, so a serving certificate, or any other
leaf the CA signed for something else, would otherwise pass as the scheduler.

What the callers present is remembered (:class:`PresentedCertificates`): kube-scheduler reads its
certificate once, at start, so after a renewal (cert-manager's, or ``gen-certs.sh``) it keeps presenting
the old one until it restarts, and the renewed Secret hides that the old one is about to expire. Only the
connections know; ``vramshare_extender_client_certificate_expiry_timestamp_seconds`` says it.
"""
from __future__ import annotations

import hashlib
import ssl
import threading
from dataclasses import dataclass
from typing import Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from vramshare import logs

__all__ = ["TlsFiles", "server_context", "peer_context", "Reloader", "ClientCertificate", "PresentedCertificates"]

log = logs.get("vramshare.extender.tls")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the serving certificate chain and key, and the CA that signs trusted clients."""

    cert: str
    key: str
    client_ca: str

    def stamp(self) -> bytes:
        """A digest of the three files' content (following symlinks, as a Secret volume's ``..data``
        swap needs); a file replaced with its mtime kept still changes it."""
        digest = hashlib.sha256()
        for path in (self.cert, self.key, self.client_ca):
            with open(path, "rb") as fh:
                data = fh.read()
            digest.update(len(data).to_bytes(8, "big") + data)
        return digest.digest()


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


def peer_context(files: TlsFiles) -> ssl.SSLContext:
    """A standby replica's client context for calling the leader: it presents ``files.cert`` (the
    scheduler's client certificate) and verifies the leader's chain against ``files.client_ca``, not its
    name (the leader's serving certificate names the Service, not the pod IP; our CA signs only our
    components)."""
    ctx = ssl.create_default_context(cafile=files.client_ca)
    ctx.check_hostname = False
    ctx.load_cert_chain(files.cert, files.key)
    return ctx


@dataclass(frozen=True)
class ClientCertificate:
    """A verified client certificate that may authenticate a caller: whose (its subject's common name),
    which (its serial) and until when (``not_after``, seconds since the epoch)."""

    subject: str
    serial: int
    not_after: float

    @classmethod
    def read(cls, leaf_der: bytes) -> "ClientCertificate":
        """The certificate the client CA verified; ``ValueError`` says why it may not authenticate a
        caller (no ``clientAuth`` extended key usage, or it does not parse)."""
        try:
            leaf = x509.load_der_x509_certificate(leaf_der)
            usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            raise ValueError("the client certificate has no extended key usage; clientAuth is required") from None
        except ValueError as exc:
            raise ValueError(f"the client certificate does not parse: {exc}") from None
        if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
            raise ValueError("the client certificate's extended key usage lacks clientAuth")
        names = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        subject = str(names[0].value) if names else leaf.subject.rfc4514_string()
        return cls(subject[:64], leaf.serial_number, leaf.not_valid_after_utc.timestamp())


class PresentedCertificates:
    """The client certificates callers presented lately, for the earliest expiry per subject.

    A certificate counts as presented while a connection authenticated by it is open (the server marks
    its open connections at every TLS check) and for ``window_s`` after: kube-scheduler's keep-alive
    connections close when idle, but its certificate stays in its memory. A restarted scheduler's new
    certificate replaces the old one within the window. Bounded: only certificates the client CA
    verified get here, and at most ``max_entries`` (the least recently presented go first)."""

    def __init__(self, window_s: float = 3600.0, max_entries: int = 32) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[tuple[str, int], tuple[ClientCertificate, float]] = {}  # -> (cert, last seen)
        self._lock = threading.Lock()  # the HTTP loop marks, a metrics scrape reads

    def seen(self, cert: ClientCertificate, now: float) -> None:
        """``cert`` authenticated a connection that is open at ``now`` (monotonic seconds)."""
        with self._lock:
            self._seen[(cert.subject, cert.serial)] = (cert, now)
            if len(self._seen) > self.max_entries:
                oldest = min(self._seen, key=lambda k: self._seen[k][1])
                del self._seen[oldest]

    def earliest(self, now: float) -> dict[str, ClientCertificate]:
        """Per subject, the presented certificate that expires first (those not seen for ``window_s``
        are forgotten)."""
        with self._lock:
            for key in [k for k, (_, at) in self._seen.items() if now - at > self.window_s]:
                del self._seen[key]
            out: dict[str, ClientCertificate] = {}
            for cert, _ in self._seen.values():
                if cert.subject not in out or cert.not_after < out[cert.subject].not_after:
                    out[cert.subject] = cert
            return out


def _load_cas(path: str) -> list[x509.Certificate]:
    with open(path, "rb") as fh:
        return x509.load_pem_x509_certificates(fh.read())


class Reloader:
    """Hand out the current context; rebuild it when the files change, keep the last good one otherwise.

    ``build`` makes the context: the server's (:func:`server_context`, checked by the server's own sweep)
    or a standby's client context for the leader (:func:`peer_context`, checked by :meth:`current` as it
    calls): a certificate read once would be presented until a restart, and a rotated CA would fail
    every forwarded verb."""

    def __init__(self, files: TlsFiles, on_result: Callable[[str], None] | None = None,
                 build: Callable[[TlsFiles], ssl.SSLContext] = server_context, check_s: float = 10.0) -> None:
        self.files = files
        self._build = build
        self._stamp = files.stamp()
        self.context = build(files)
        self.on_result = on_result  # "reloaded" / "refused": vramshare_extender_tls_reloads_total
        self.client_cas = _load_cas(files.client_ca)
        self.presented = PresentedCertificates()
        self.check_s = check_s
        self._next_check = 0.0
        self._lock = threading.Lock()  # current() runs on the worker threads

    def current(self, now: float) -> ssl.SSLContext:
        """The context in force, the files re-read first when ``check_s`` passed since they last were."""
        with self._lock:
            if now >= self._next_check:
                self._next_check = now + self.check_s
                self.check()
            return self.context

    def still_trusted(self, leaf_der: bytes) -> bool:
        """Whether a client CA in force now directly issued ``leaf_der`` (a connection authenticated
        before a rotation). A leaf under an intermediate cannot be re-checked here (the chain is not
        kept) and counts as not trusted: its client reconnects under the new context."""
        try:
            leaf = x509.load_der_x509_certificate(leaf_der)
        except ValueError:
            return False
        for ca in self.client_cas:
            try:
                leaf.verify_directly_issued_by(ca)
            except (ValueError, TypeError, InvalidSignature):
                continue
            return True
        return False

    def check(self) -> bool:
        """Reload when a file changed; True when a new context is in force. Never raises."""
        try:
            stamp = self.files.stamp()
            if stamp == self._stamp:
                return False
            context = self._build(self.files)
            cas = _load_cas(self.files.client_ca)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("tls files changed but do not load; keeping the previous certificates",
                        cert=self.files.cert, error=str(exc))
            if self.on_result is not None:
                self.on_result("refused")
            return False
        self._stamp, self.context, self.client_cas = stamp, context, cas
        if self.on_result is not None:
            self.on_result("reloaded")
        log.info("tls certificates reloaded", cert=self.files.cert, client_ca=self.files.client_ca)
        return True
