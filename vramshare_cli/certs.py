"""The extender's mutual-TLS certificates, made in place (what deploy/tls/gen-certs.sh makes with openssl).

One throw-away CA (EC P-256) signs the extender's serving certificate and kube-scheduler's client
certificate; its key is dropped, so nobody can mint another trusted client later. The serving
certificate names the Service (every DNS form) and ``localhost`` / ``127.0.0.1``, so ``vramshare
inspect`` through ``kubectl port-forward`` verifies it too.
"""
from __future__ import annotations

import base64
import datetime
import ipaddress
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pem", "MutualTls", "generate", "secrets", "service_names"]

EXTENDER_SECRET = "vramshare-extender-tls"
SCHEDULER_SECRET = "vramshare-scheduler-tls"
SERVICE = "vramshare-extender"


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


@dataclass(frozen=True)
class MutualTls:
    ca: bytes
    server: Pem
    client: Pem


def service_names(namespace: str, service: str = SERVICE) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
                         crl_sign=cert_sign, encipher_only=False, decipher_only=False)


def generate(namespace: str, days: int = 365, now: datetime.datetime | None = None) -> MutualTls:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("vramshare-extender-ca")).issuer_name(_name("vramshare-extender-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days + 30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(_usage(cert_sign=True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(_usage(cert_sign=False), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    names = service_names(namespace)
    server = leaf(names[2], ExtendedKeyUsageOID.SERVER_AUTH,
                  [x509.DNSName(n) for n in names + ["localhost"]] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = leaf("vramshare-scheduler", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return MutualTls(ca.public_bytes(serialization.Encoding.PEM), server, client)


def secrets(tls: MutualTls, namespace: str) -> list[dict[str, Any]]:
    """The two Secrets extender.yaml and scheduler.yaml mount (the layout gen-certs.sh and cert-manager write)."""
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()
    return [{"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
             "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "vramshare"}},
             "data": {"tls.crt": b64(pem.cert), "tls.key": b64(pem.key), "ca.crt": b64(tls.ca)}}
            for name, pem in ((EXTENDER_SECRET, tls.server), (SCHEDULER_SECRET, tls.client))]
