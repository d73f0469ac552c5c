"""The official Kubernetes client, as the operator, the SDK and `kubectl jaxps` use it.

`load()` is the one place credentials are read, by the client's own loaders: in a pod its
service account (the token re-read as it rotates), elsewhere a kubeconfig ($KUBECONFIG or
~/.kube/config, or one given) with everything the client knows: client certificates, tokens and
token files, `exec` credential plugins (EKS, GKE, AKS) and their refresh, proxies.

`Api.call(method, path, ...)` makes one request through the client's `ApiClient` (its urllib3
pool, its authentication) with plain dicts in and out: the client's generated API classes
would turn every pod into a tree of models and back (a CoreV1Api import alone is +21 MB, and a
pod through its models costs ten times its JSON: research/kopf-operator.md, sections 3-4).
A refusal raises the client's own `ApiException` (its status, reason and the API server's body).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

__all__ = ["Api", "ApiError", "Loaded", "LoadError", "load", "message_of"]

ApiError = ApiException
TIMEOUT = 60.0  # seconds a call may take
CONNECTIONS = 32  # kept connections: at least the threads that call at once
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_AUTH = ["BearerToken"]


class LoadError(ValueError):
    """No credentials could be loaded; the message says from where it looked and why."""


@dataclass(frozen=True)
class Loaded:
    """The client's configuration, and the namespace the credentials name (the kubeconfig
    context's, or the service account's), if any."""

    configuration: client.Configuration
    namespace: str | None
    in_cluster: bool


def service_account_namespace() -> str | None:
    path = SERVICE_ACCOUNT / "namespace"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def load(
    *,
    kubeconfig: str | None = None,
    context: str | None = None,
    pod_first: bool = False,
    default: bool = False,
) -> Loaded:
    """The credentials, by the client's loaders: a kubeconfig (`kubeconfig`, else $KUBECONFIG,
    else ~/.kube/config; its `context` or current context) or the pod's service account.
    `pod_first` (the operator): the service account wins inside a pod; else (the SDK, the CLI)
    the kubeconfig does. `default`: the client's default configuration is set to it as well
    (the client's leader election reads that one). `LoadError` names what was tried."""
    configuration = client.Configuration()

    def from_pod() -> Loaded:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return Loaded(configuration, service_account_namespace(), True)

    def from_file() -> Loaded:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        if context is not None:
            active = next((c for c in contexts if c.get("name") == context), active)
        return Loaded(configuration, (active or {}).get("context", {}).get("namespace"), False)

    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    explicit = kubeconfig is not None or context is not None
    try:
        if pod_first and in_pod and not explicit:
            loaded = from_pod()
        else:
            try:
                loaded = from_file()
            except (ConfigException, FileNotFoundError, TypeError) as err:
                if explicit or not in_pod:
                    where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
                    raise LoadError(
                        f"no Kubernetes credentials: kubeconfig {where}: {err}"
                        + ("" if explicit else "; and not in a pod (no service account)")
                    ) from None
                loaded = from_pod()
    except ConfigException as err:
        raise LoadError(f"the pod's service account: {err}") from None
    if default:
        client.Configuration.set_default(configuration)
    return loaded


def message_of(err: ApiException) -> str:
    """The API server's own words in a refusal's Status body, else its reason."""
    try:
        return str(json.loads(err.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(err.reason or err.status)


class Api:
    """Raw JSON calls through one `ApiClient`. Thread-safe (the client's urllib3 pool is)."""

    def __init__(self, configuration: client.Configuration | None = None) -> None:
        if configuration is None:
            configuration = load(pod_first=True, default=True).configuration
        configuration.connection_pool_maxsize = max(
            CONNECTIONS, configuration.connection_pool_maxsize or 0
        )
        self.client = client.ApiClient(configuration)
        self.host = str(configuration.host)

    def call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = TIMEOUT,
    ) -> Any:
        """One request; the decoded JSON answer (None when empty), or `ApiError`."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        request = self.client.param_serialize(
            method,
            path,
            query_params=params,
            header_params=headers,
            body=body,
            auth_settings=_AUTH,
        )
        response = self.client.call_api(*request, _request_timeout=timeout)
        data = response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(data) if data else None

    def close(self) -> None:
        self.client.close()  # type: ignore[no-untyped-call]
