"""A job's credentials: its own certificate authority and one certificate per task.

    authority(job)                                   -> Authority (a CA for this job only)
    issue(ca, Identity(job, role, index), hosts=...) -> TaskCredentials (cert, key, the CA)
    identity_of(cert_pem)                            -> Identity | None

A task has two certificates for one key, so that a stranger learns nothing from it:

- its client certificate names it, a URI `jaxps://<job uid>/<role>/<index>` (its only subject
  alternative name), from which a server learns which task calls it. A client sends it only
  when a server asks, after the server proved to be of the job's CA (TLS 1.3 encrypts it).
- its server certificate, the one any peer that connects sees before it authenticates, names
  nothing: common name "jaxps", issuer "jaxps CA", and as its only name `server_name(host)`,
  a hash of the job's CA certificate and the host its peers dial (its DNS name, or 127.0.0.1
  locally). A peer of the job computes the same name and checks it, so TLS still makes sure the
  server is the task at the address dialled; a stranger, who has no CA certificate (a server
  sends only its own), cannot tell the job, the role or even the host name from it.

Only certificates of the job's own CA pass the TLS handshake, so a task of another job (another
CA) never gets as far as a call. Keys are ECDSA P-256: fast to make (one per task per job) and
to handshake with. Credentials issued before the split (one certificate naming the task and its
hosts) still work: that certificate serves both ends, and peers check the host itself.

On disk (a task's credentials directory, the files of its Secret): `ca.crt`, `tls.crt` (the
client certificate, then the server certificate), `tls.key`. Key bytes are never logged or put
in an exception message. Uses `cryptography` only; standard library otherwise (the operator,
which has no JAX, makes them too).
"""

from __future__ import annotations

import datetime
import hashlib
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
SERVER_DOMAIN = "jaxps.invalid"  # server names are <hash>.jaxps.invalid: never resolved
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


def split_host(address: str) -> str:
    """The host of "host:port" (an IPv6 host without its brackets), as a peer dials it."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def server_name(ca_cert: bytes, host: str) -> str:
    """The name a task's server certificate carries for `host`, and that its peers check: a
    hash of the job's CA certificate (PEM) and the host, which tells a stranger nothing."""
    return _server_name(x509.load_pem_x509_certificate(ca_cert), host)


def _server_name(ca_cert: x509.Certificate, host: str) -> str:
    der = ca_cert.public_bytes(serialization.Encoding.DER)
    digest = hashlib.sha256(der + b"\0" + host.encode("utf-8")).hexdigest()[:32]
    return f"{digest}.{SERVER_DOMAIN}"


def _pems(bundle: bytes) -> list[bytes]:
    """The PEM certificates of a bundle, in order."""
    marker = b"-----BEGIN CERTIFICATE-----"
    return [marker + part for part in bundle.split(marker)[1:]]


@dataclass(frozen=True)
class TaskCredentials:
    """What one task needs for mutual TLS: its certificates and key, and its job's CA (PEM).
    `cert` is the client certificate, then the server certificate (or one for both)."""

    ca: bytes
    cert: bytes
    key: bytes

    @property
    def client_cert(self) -> bytes:
        """The certificate this task calls with: it names the task."""
        return _pems(self.cert)[0]

    @property
    def server_cert(self) -> bytes:
        """The certificate this task serves with: it names nothing (`server_name`)."""
        return _pems(self.cert)[-1]

    def server_name(self, host: str) -> str:
        """The name to check on the certificate of the server at `host` (dialled there)."""
        if len(_pems(self.cert)) < 2:
            return host  # credentials of before the split: the certificate names its hosts
        return server_name(self.ca, host)

    def __repr__(self) -> str:  # never the key
        return (
            f"TaskCredentials(ca={len(self.ca)} bytes, cert={len(self.cert)} bytes, key=<hidden>)"
        )

    def identity(self) -> Identity | None:
        return identity_of(self.client_cert)

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
        is written to a private temporary directory and removed at once. A server presents its
        server certificate, a client its client certificate (`server_name` for what to check
        of the server's)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.ca.decode("ascii"))
        own = TaskCredentials(
            ca=self.ca, cert=self.server_cert if server else self.client_cert, key=self.key
        )
        with tempfile.TemporaryDirectory(prefix="jaxps-tls-") as tmp:  # mode 0700
            own.write(Path(tmp))
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
            certs = [x509.load_pem_x509_certificate(c) for c in _pems(loaded.cert)]
            x509.load_pem_x509_certificate(loaded.ca)
            key = serialization.load_pem_private_key(loaded.key, password=None)
        except ValueError:
            certs = []
        if not certs:
            raise CredentialsError(f"{directory}: {CA_FILE}, {CERT_FILE} or {KEY_FILE} is not PEM")
        if any(cert.public_key() != key.public_key() for cert in certs):
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
    """A new CA for job `job` (its uid) alone; its name does not say which job (see below)."""
    key = ec.generate_private_key(ec.SECP256R1())
    # Every leaf names its CA as issuer, and a server's leaf is seen by whoever connects: the
    # name says nothing of the job.
    del job
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxps CA")])
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


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    *,
    common_name: str,
    names: Sequence[x509.GeneralName],
    usage: x509.ObjectIdentifier,
) -> bytes:
    start, end = _window()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def issue(ca: Authority, identity: Identity, *, hosts: Sequence[str]) -> TaskCredentials:
    """The credentials of one task: a client certificate naming it, and a server certificate
    for `hosts` (the hosts its peers dial) that names nothing but `server_name` of each."""
    return issue_many(ca, [(identity, hosts)])[0]


def issue_many(
    ca: Authority, tasks: Sequence[tuple[Identity, Sequence[str]]]
) -> list[TaskCredentials]:
    """`issue` for each (identity, hosts), the CA read once (not twice a task)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CredentialsError("the CA's key is not an ECDSA key")
    issued = []
    for identity, hosts in tasks:
        key = ec.generate_private_key(ec.SECP256R1())
        client = _leaf(
            ca_cert,
            ca_key,
            key,
            common_name="jaxps task",
            names=[x509.UniformResourceIdentifier(identity.uri)],
            usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        )
        server = _leaf(
            ca_cert,
            ca_key,
            key,
            common_name="jaxps",
            names=[x509.DNSName(_server_name(ca_cert, h)) for h in dict.fromkeys(hosts)],
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
        )
        issued.append(TaskCredentials(ca=ca.cert, cert=client + server, key=_pem_key(key)))
    return issued


def identity_of(cert_pem: bytes) -> Identity | None:
    """The task a certificate (the first of a bundle) names, by its first jaxps URI; None when
    it names none."""
    try:
        cert = x509.load_pem_x509_certificate((_pems(cert_pem) or [cert_pem])[0])
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in names.get_values_for_type(x509.UniformResourceIdentifier):
        found = Identity.parse(uri)
        if found is not None:
            return found
    return None
