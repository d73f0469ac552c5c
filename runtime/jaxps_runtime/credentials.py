"""A job's credentials: its own certificate authority and one certificate per task.

    authority(job)                                   -> Authority (a CA for this job only)
    issue(ca, Identity(job, role, index), hosts=...) -> TaskCredentials (cert, key, the CA)
    identity_of(cert_pem)                            -> Identity | None

A task's certificate names it twice: its DNS name (or 127.0.0.1 locally) as a subject
alternative name, so that TLS checks the peer is where it was dialled, and a URI
`jaxps://<job uid>/<role>/<index>`, from which a server learns which task calls it. Only
certificates of the job's own CA pass the TLS handshake, so a task of another job (another CA)
never gets as far as a call. Keys are ECDSA P-256: fast to make (one per task per job) and to
handshake with.

On disk (a task's credentials directory, the files of its Secret): `ca.crt`, `tls.crt`,
`tls.key`. Key bytes are never logged or put in an exception message. Uses `cryptography`
only; standard library otherwise (the operator, which has no JAX, makes them too).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SCHEME = "jaxps"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
VALID_DAYS = 365
ROLES = ("chief", "ps", "worker", "evaluator")


class CredentialsError(ValueError):
    """Credentials that cannot be read or do not fit together; the message names the file."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate speaks for: one task of one job."""

    job: str  # the job's uid (its name where there is no uid)
    role: str
    index: int

    @property
    def uri(self) -> str:
        return f"{SCHEME}://{self.job}/{self.role}/{self.index}"

    @classmethod
    def parse(cls, uri: str) -> Identity | None:
        """The identity a `jaxps://job/role/index` URI names; None for anything else."""
        prefix = f"{SCHEME}://"
        if not uri.startswith(prefix):
            return None
        parts = uri[len(prefix) :].split("/")
        if (
            len(parts) != 3
            or not parts[0]
            or parts[1] not in ROLES
            or not (parts[2].isascii() and parts[2].isdigit())
        ):
            return None
        return cls(job=parts[0], role=parts[1], index=int(parts[2]))

    def __str__(self) -> str:
        return f"{self.role} {self.index} of job {self.job}"


@dataclass(frozen=True)
class Authority:
    """A job's CA: its certificate and key (PEM)."""

    cert: bytes
    key: bytes

    def __repr__(self) -> str:  # never the key
        return f"Authority(cert={len(self.cert)} bytes, key=<hidden>)"


@dataclass(frozen=True)
class TaskCredentials:
    """What one task needs for mutual TLS: its certificate and key, and its job's CA (PEM)."""

    ca: bytes
    cert: bytes
    key: bytes

    def __repr__(self) -> str:  # never the key
        return (
            f"TaskCredentials(ca={len(self.ca)} bytes, cert={len(self.cert)} bytes, key=<hidden>)"
        )

    def identity(self) -> Identity | None:
        return identity_of(self.cert)

    def write(self, directory: Path) -> None:
        """The three files, the key readable by its owner only."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CA_FILE).write_bytes(self.ca)
        (directory / CERT_FILE).write_bytes(self.cert)
        key = directory / KEY_FILE
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(self.key)

    def ssl_context(self, *, server: bool) -> ssl.SSLContext:
        """Mutual TLS with Python's ssl module, as gRPC does it (`rpc`) for the bulk path:
        the peer must present a certificate of the job's CA; a client also checks that the
        server's certificate names the host it dialled. ssl loads a key only from a file: it
        is written to a private temporary directory and removed at once."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.ca.decode("ascii"))
        with tempfile.TemporaryDirectory(prefix="jaxps-tls-") as tmp:  # mode 0700
            self.write(Path(tmp))
            context.load_cert_chain(Path(tmp) / CERT_FILE, Path(tmp) / KEY_FILE)
        return context

    @classmethod
    def load(cls, directory: Path) -> TaskCredentials:
        """Reads a credentials directory; `CredentialsError` names what is missing or wrong."""
        files = {}
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            try:
                files[name] = (directory / name).read_bytes()
            except OSError as err:
                raise CredentialsError(
                    f"{directory / name}: cannot read it ({err.strerror}); a credentials "
                    f"directory holds {CA_FILE}, {CERT_FILE} and {KEY_FILE}"
                ) from None
        loaded = cls(ca=files[CA_FILE], cert=files[CERT_FILE], key=files[KEY_FILE])
        try:
            cert = x509.load_pem_x509_certificate(loaded.cert)
            x509.load_pem_x509_certificate(loaded.ca)
            key = serialization.load_pem_private_key(loaded.key, password=None)
        except ValueError:
            raise CredentialsError(
                f"{directory}: {CA_FILE}, {CERT_FILE} or {KEY_FILE} is not PEM"
            ) from None
        if cert.public_key() != key.public_key():
            raise CredentialsError(f"{directory}: {KEY_FILE} is not the key of {CERT_FILE}")
        if loaded.identity() is None:
            raise CredentialsError(
                f"{directory / CERT_FILE}: names no jaxps task (a URI {SCHEME}://JOB/ROLE/INDEX)"
            )
        return loaded


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _window() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)


def authority(job: str) -> Authority:
    """A new CA for job `job` (its uid) alone."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"jaxps job {job} CA")])
    start, end = _window()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Authority(cert=cert.public_bytes(serialization.Encoding.PEM), key=_pem_key(key))


def _alternative_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(ca: Authority, identity: Identity, *, hosts: Sequence[str]) -> TaskCredentials:
    """A certificate for one task, valid as server (at `hosts`) and as client."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("the CA's key is not an ECDSA key")
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _window()
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    names += [_alternative_name(h) for h in dict.fromkeys(hosts)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [x509.NameAttribute(NameOID.COMMON_NAME, f"{identity.role}-{identity.index}")]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return TaskCredentials(
        ca=ca.cert, cert=cert.public_bytes(serialization.Encoding.PEM), key=_pem_key(key)
    )


def identity_of(cert_pem: bytes) -> Identity | None:
    """The task a certificate names (its first jaxps URI); None when it names none."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in names.get_values_for_type(x509.UniformResourceIdentifier):
        found = Identity.parse(uri)
        if found is not None:
            return found
    return None
