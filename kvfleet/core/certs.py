"""The cluster CA and its certificates, on disk (``cryptography``; no grpc).

    DIR/ca/ca.crt, ca.key                 the cluster CA (keep ca.key off the serving machines)
    DIR/<stem>/ca.crt, tls.crt, tls.key   one identity's (``kvfleet.core.identity``): router,
                                          block-service, admin, etcd, node-<id>

Each identity's directory has cert-manager's Secret layout, so a Kubernetes Secret mounts where a
``kvfleet certs issue`` directory would. Keys are ECDSA P-256 (cheap handshakes), written 0600 in
0700 directories. A certificate names its identity in the common name and carries its host name
(``Identity.host_name``), ``localhost``, ``127.0.0.1`` and whatever hosts it is issued for (a compose
service name, a pod's DNS name) as subject alternative names; it is good for both ends of a
connection (server and client auth). Nothing here replaces an existing file: ``kvfleet up`` makes
what is missing and rotates nothing by surprise; ``kvfleet certs issue --force`` re-issues.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvfleet.core.identity import Identity

CA_STEM = "ca"
CA_FILE, CERT_FILE, KEY_FILE, CA_KEY_FILE = "ca.crt", "tls.crt", "tls.key", "ca.key"
CA_DAYS, CERT_DAYS = 3650, 365
LOCAL_HOSTS = ("localhost", "127.0.0.1")


class CertError(ValueError):
    """A certificate directory that cannot be used; the message is one line."""


@dataclass(frozen=True, slots=True)
class CertInfo:
    identity: Identity | None  # None: a common name that is no kvfleet identity (the CA's)
    not_before: dt.datetime
    not_after: dt.datetime
    issuer: str

    def seconds_left(self, now: dt.datetime | None = None) -> float:
        return (self.not_after - (now or _now())).total_seconds()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvfleet"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def ca_dir(certs_dir: str | Path) -> Path:
    return Path(certs_dir) / CA_STEM


def identity_dir(certs_dir: str | Path, identity: Identity) -> Path:
    return Path(certs_dir) / identity.file_stem


def init_ca(certs_dir: str | Path, days: int = CA_DAYS, common_name: str = "kvfleet cluster CA") -> bool:
    """Make the cluster CA under ``certs_dir/ca``; False (nothing written) when one is there."""
    where = ca_dir(certs_dir)
    if (where / CA_FILE).exists():
        return False
    key = ec.generate_private_key(ec.SECP256R1())
    start = _now() - dt.timedelta(minutes=5)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(where / CA_KEY_FILE, _key_pem(key))
    (where / CA_FILE).write_bytes(_cert_pem(cert))
    return True


def _load_ca(certs_dir: str | Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    where = ca_dir(certs_dir)
    try:
        cert = x509.load_pem_x509_certificate((where / CA_FILE).read_bytes())
        key = serialization.load_pem_private_key((where / CA_KEY_FILE).read_bytes(), password=None)
    except FileNotFoundError:
        raise CertError(f"no cluster CA in {where} (run `kvfleet certs init {certs_dir}` first)") from None
    except ValueError as err:
        raise CertError(f"the CA in {where} does not load: {err}") from None
    return cert, key


def _alt_names(identity: Identity, hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([identity.host_name, *LOCAL_HOSTS, *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(certs_dir: str | Path, identity: Identity, hosts: Iterable[str] = (), days: float = CERT_DAYS,
          force: bool = False, not_before: dt.datetime | None = None) -> Path:
    """Issue ``identity``'s certificate into ``certs_dir/<stem>`` (with the CA's certificate beside
    it) and return that directory; an existing one is kept unless ``force``."""
    out = identity_dir(certs_dir, identity)
    if (out / CERT_FILE).exists() and not force:
        return out
    ca_cert, ca_key = _load_ca(certs_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or (_now() - dt.timedelta(minutes=5))
    cert = (x509.CertificateBuilder().subject_name(_name(str(identity))).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_alt_names(identity, hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(out / KEY_FILE, _key_pem(key))
    (out / CERT_FILE).write_bytes(_cert_pem(cert))
    (out / CA_FILE).write_bytes(_cert_pem(ca_cert))
    return out


def ensure(certs_dir: str | Path, identities: Iterable[Identity], hosts: Iterable[str] = ()) -> list[Identity]:
    """The CA and each identity's certificate, made where missing (``kvfleet up``); the ones made."""
    init_ca(certs_dir)
    hosts = tuple(hosts)
    made = []
    for identity in identities:
        if not (identity_dir(certs_dir, identity) / CERT_FILE).exists():
            issue(certs_dir, identity, hosts)
            made.append(identity)
    return made


def info(cert_pem: bytes) -> CertInfo:
    """What a PEM certificate says of itself; CertError when it does not parse."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise CertError(f"not a PEM certificate: {err}") from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        identity = Identity.parse(str(names[0].value)) if names else None
    except ValueError:
        identity = None
    return CertInfo(identity, cert.not_valid_before_utc, cert.not_valid_after_utc, cert.issuer.rfc4514_string())
