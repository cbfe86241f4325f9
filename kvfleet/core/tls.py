"""This process's place in the cluster's mutual TLS: its identity and credentials, loaded once at
start (``configure``) and read by ``kvfleet.core.rpc`` for every internal server and channel, and by the
etcd client (``kvfleet.core.membership.etcd_client``).

A process that never configures (a unit test's in-process server) speaks plaintext, as before; a
service must choose (``InternalTls.require_choice``): with ``--insecure-internal`` it says so, loud,
at start. A certificate directory is checked whole before anything listens: the three files there,
the certificate signed by the CA beside it, naming the identity the service runs as (a node
started as node-1 with node-0's certificate refuses to start), and not expired.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from kvfleet.core import certs
from kvfleet.core.certs import CertInfo
from kvfleet.core.identity import Identity
from kvfleet.core.settings import SettingError
from kvfleet.core.tls_settings import InternalTls

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Credentials:
    identity: Identity
    ca: bytes
    cert: bytes
    key: bytes
    info: CertInfo
    directory: Path

    @classmethod
    def load(cls, directory: str | Path, identity: Identity | None = None) -> Credentials:
        """The credentials in ``directory``, checked; SettingError (one line) when unusable.
        ``identity``: the one the certificate must name (None: whichever it names)."""
        directory = Path(directory)
        try:
            ca, cert, key = (
                (directory / name).read_bytes() for name in (certs.CA_FILE, certs.CERT_FILE, certs.KEY_FILE))
        except OSError as err:
            raise SettingError(f"--certs {directory}: {err.strerror}: {err.filename} "
                               f"(`kvfleet certs issue` writes ca.crt, tls.crt and tls.key)") from None
        try:
            info = certs.info(cert)
            _check_signed(cert, ca)
            _check_key(cert, key)
        except (certs.CertError, ValueError, InvalidSignature) as err:
            raise SettingError(f"--certs {directory}: {err or 'tls.crt is not signed by ca.crt'}") from None
        if info.identity is None:
            raise SettingError(f"--certs {directory}: the certificate names no kvfleet identity")
        if identity is not None and info.identity != identity:
            raise SettingError(f"--certs {directory}: the certificate is {info.identity}'s, this service runs "
                               f"as {identity}")
        if info.not_before > dt.datetime.now(dt.timezone.utc):
            raise SettingError(f"--certs {directory}: {info.identity}'s certificate is valid only from "
                               f"{info.not_before:%Y-%m-%d %H:%M} UTC (this machine's clock, or an early issue)")
        if info.seconds_left() <= 0:
            raise SettingError(f"--certs {directory}: {info.identity}'s certificate expired on "
                               f"{info.not_after:%Y-%m-%d %H:%M} UTC")
        return cls(info.identity, ca, cert, key, info, directory)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server that asks every client for a certificate of this CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _check_signed(cert_pem: bytes, ca_pem: bytes) -> None:
    cert, ca = x509.load_pem_x509_certificate(cert_pem), x509.load_pem_x509_certificate(ca_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError("tls.crt is not signed by the ca.crt beside it") from None


def _check_key(cert_pem: bytes, key_pem: bytes) -> None:
    """tls.key is a private key, and the one of tls.crt."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise ValueError("tls.key is not an unencrypted PEM private key") from None
    public = x509.load_pem_x509_certificate(cert_pem).public_key()
    der = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*der) != public.public_bytes(*der):
        raise ValueError("tls.key is not the key of tls.crt")


_current: Credentials | None = None


def configure(settings: InternalTls, identity: Identity | None, service: str) -> Credentials | None:
    """Load this process's credentials (``identity``: the one they must name), or note plaintext;
    SettingError when neither was chosen or the directory does not hold. Returns the credentials."""
    global _current
    settings.require_choice()
    if settings.insecure_internal:
        _current = None
        log.warning("%s: --insecure-internal: internal connections are PLAINTEXT and UNAUTHENTICATED; anyone who "
                    "can reach this port can call every internal method. Never run it so on a shared network.",
                    service)
        return None
    _current = Credentials.load(settings.certs, identity)
    days = _current.info.seconds_left() / 86400
    log.info("%s: mutual TLS as %s (certificate valid %.0f more days)", service, _current.identity, days)
    return _current


def use(credentials: Credentials | None) -> None:
    """Set this process's credentials directly (a command line client, a test)."""
    global _current
    _current = credentials


def current() -> Credentials | None:
    return _current


def seconds_left(now: dt.datetime | None = None) -> float | None:
    """How long this process's certificate has left (None: plaintext)."""
    return None if _current is None else _current.info.seconds_left(now)
