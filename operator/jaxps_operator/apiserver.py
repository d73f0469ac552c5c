"""The operator's client of the API server: JSON over kept-alive HTTPS, and watch streams.

The operator needs a dozen REST calls and four watches. The official client and kopf cost it
more than Kubeflow's whole process does (their imports alone were 77 MB resident: the client's
thousand model classes, aiohttp, pydantic), and every call went through the client's model
machinery. This module is `http.client` and `ssl` from the standard library:

- `Api.from_environment()`: in a pod its service account (the token re-read every minute, as
  bound tokens rotate); elsewhere $KUBECONFIG or ~/.kube/config, its current context: the
  server, its CA (file or data, or insecure-skip-tls-verify), and a client certificate and key
  (files or data), a token or a tokenFile. A kubeconfig that authenticates otherwise (exec
  plugins, auth providers) is refused with the field named.
- `Api.call(method, path, ...)`: one request on a connection from a pool of kept-alive ones
  (a new TLS handshake per call once took half of the operator's CPU); the JSON answer, or
  `ApiError` with the status and the API server's own message. A call on a kept connection that
  the server closed meanwhile is sent again once on a new one: every caller treats a repeated
  create (409), delete (404) or guarded write (409) as the answer it is.
- `Api.stream(path, ...)`: a watch, one event a line, on a connection of its own.

Thread-safe: passes call it from several threads at once.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import queue
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONNECTIONS = 32  # idle connections kept: at least the threads that call at once
TIMEOUT = 60.0  # seconds a call may take
TOKEN_REFRESH = 60.0  # seconds between reads of a service account's token file
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
USER_AGENT = "jaxps-operator"
_RETRIED = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class ApiError(Exception):
    """The API server refused a request (or answered one that cannot be read)."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(f"({status}) {reason}: {message_of(body) or reason}")


def message_of(body: str) -> str:
    """The API server's own words in a Status body, or '' when it has none."""
    try:
        return str(json.loads(body)["message"])
    except (TypeError, ValueError, KeyError):
        return ""


class ConfigError(ValueError):
    """A kubeconfig or service account this client cannot use; names the field."""


@dataclass(frozen=True)
class Server:
    """Where the API server is and how to reach it: scheme, host, port, TLS and credentials."""

    scheme: str
    host: str
    port: int
    context: ssl.SSLContext | None
    token: str | None = None
    token_file: Path | None = None


def _data_or_file(entry: Mapping[str, Any], key: str, base: Path) -> bytes | None:
    """`key-data` (base64) or `key` (a path, relative to the kubeconfig's folder) of an entry."""
    data = entry.get(f"{key}-data")
    if data:
        return base64.b64decode(data)
    path = entry.get(key)
    if path:
        return (base / str(path)).expanduser().read_bytes()
    return None


def _tls(
    *, ca: bytes | None, insecure: bool, cert: bytes | None, key: bytes | None
) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif ca is not None:
        context = ssl.create_default_context(cadata=ca.decode())
    if cert is not None and key is not None:
        # ssl loads a key pair only from files: written for the call, readable by us alone
        with tempfile.TemporaryDirectory(prefix="jaxps-client-") as folder:
            (Path(folder) / "tls.crt").write_bytes(cert)
            key_path = Path(folder) / "tls.key"
            key_path.touch(mode=0o600)
            key_path.write_bytes(key)
            context.load_cert_chain(str(Path(folder) / "tls.crt"), str(key_path))
    return context


def _split(url: str) -> tuple[str, str, int]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"server: got {url!r}; expected an https:// or http:// URL")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.scheme, parsed.hostname, port


def in_cluster() -> Server:
    """The pod's service account and the API server's Service."""
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = int(os.environ.get("KUBERNETES_SERVICE_PORT", "443"))
    ca = (SERVICE_ACCOUNT / "ca.crt").read_bytes()
    return Server(
        scheme="https",
        host=host,
        port=port,
        context=_tls(ca=ca, insecure=False, cert=None, key=None),
        token_file=SERVICE_ACCOUNT / "token",
    )


def from_kubeconfig(path: Path) -> Server:
    """The current context of a kubeconfig file."""
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"kubeconfig {path}: {err}") from err

    def named(kind: str, name: str) -> dict[str, Any]:
        for item in doc.get(f"{kind}s") or []:
            if item.get("name") == name:
                return dict(item.get(kind) or {})
        raise ConfigError(f"kubeconfig {path}: {kind} {name!r} is not in {kind}s")

    current = doc.get("current-context")
    if not current:
        raise ConfigError(f"kubeconfig {path}: current-context is not set")
    context = named("context", str(current))
    cluster = named("cluster", str(context.get("cluster")))
    user = named("user", str(context.get("user"))) if context.get("user") else {}
    for unsupported in ("exec", "auth-provider", "username"):
        if unsupported in user:
            raise ConfigError(
                f"kubeconfig {path}: users[{context.get('user')}].{unsupported} is not supported "
                "by the operator; use a client certificate, a token or a tokenFile"
            )
    base = path.parent
    scheme, host, port = _split(str(cluster.get("server") or ""))
    context_ = None
    if scheme == "https":
        context_ = _tls(
            ca=_data_or_file(cluster, "certificate-authority", base),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            cert=_data_or_file(user, "client-certificate", base),
            key=_data_or_file(user, "client-key", base),
        )
    token_file = user.get("tokenFile")
    return Server(
        scheme=scheme,
        host=host,
        port=port,
        context=context_,
        token=str(user["token"]) if user.get("token") else None,
        token_file=(base / str(token_file)) if token_file else None,
    )


class Api:
    """Calls on one API server. Thread-safe."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._idle: queue.LifoQueue[http.client.HTTPConnection] = queue.LifoQueue(CONNECTIONS)
        self._token = server.token
        self._token_read = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls) -> Api:
        """In a pod: its service account; elsewhere $KUBECONFIG's first file or ~/.kube/config."""
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls(in_cluster())
        paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        return cls(from_kubeconfig(Path(paths[0] if paths else "~/.kube/config").expanduser()))

    # --- connections ----------------------------------------------------------------------------

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.server.scheme == "https":
            return http.client.HTTPSConnection(
                self.server.host, self.server.port, timeout=timeout, context=self.server.context
            )
        return http.client.HTTPConnection(self.server.host, self.server.port, timeout=timeout)

    def _headers(self, body: bytes | None, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = content_type
        return headers

    def _bearer(self) -> str | None:
        path = self.server.token_file
        if path is None:
            return self._token
        with self._lock:
            if time.monotonic() - self._token_read > TOKEN_REFRESH or self._token is None:
                self._token = path.read_text().strip()
                self._token_read = time.monotonic()
            return self._token

    @staticmethod
    def url(path: str, query: Mapping[str, Any] | None = None) -> str:
        if not query:
            return path
        return f"{path}?{urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})}"

    # --- calls ----------------------------------------------------------------------------------

    def call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        """One request; the decoded JSON answer (None when empty), or `ApiError`."""
        payload = None if body is None else json.dumps(body).encode()
        url = self.url(path, query)
        for attempt in (0, 1):
            try:
                if attempt:  # a new one: the next kept connection may be as stale
                    raise queue.Empty
                conn = self._idle.get_nowait()
                reused = True
            except queue.Empty:
                conn, reused = self._connect(TIMEOUT), False
            try:
                conn.request(method, url, payload, self._headers(payload, content_type))
                response = conn.getresponse()
                data = response.read()
            except _RETRIED:
                conn.close()
                if reused and attempt == 0:
                    continue  # the server closed a kept connection: once more on a new one
                raise
            except BaseException:
                conn.close()
                raise
            if response.will_close:
                conn.close()
            else:
                try:
                    self._idle.put_nowait(conn)
                except queue.Full:
                    conn.close()
            if response.status >= 400:
                raise ApiError(response.status, response.reason, data.decode(errors="replace"))
            return json.loads(data) if data else None
        raise AssertionError("unreachable")

    def stream(
        self, path: str, *, query: Mapping[str, Any], timeout: float
    ) -> Iterator[dict[str, Any]]:
        """The events of a watch, decoded, until the server ends it; its own connection,
        closed when the iterator is. `timeout`: the longest silence before `TimeoutError`."""
        conn = self._connect(timeout)
        try:
            conn.request("GET", self.url(path, query), headers=self._headers(None, ""))
            response = conn.getresponse()
            if response.status >= 400:
                body = response.read().decode(errors="replace")
                raise ApiError(response.status, response.reason, body)
            while line := response.readline():
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()
