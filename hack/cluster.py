"""A local Kubernetes control plane on 127.0.0.1, for `make cluster-up` and the cluster tests.

    python hack/cluster.py up   [--dir DIR]   etcd, kube-apiserver, kube-controller-manager and
                                              kube-scheduler from hack/control-plane.sh's cache,
                                              on free ports; writes DIR/kubeconfig
    python hack/cluster.py down [--dir DIR]   stops them and removes DIR

DIR defaults to .cluster in the repo. The processes run in their own sessions (they outlive
`up`), log to DIR/logs/ and are stopped through DIR/pids. There is no kubelet: pods are
created and scheduled nowhere, and tests move their phases by writing pod status, as envtest
users do. The garbage collector, namespace and service-account controllers of
kube-controller-manager do run. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "jaxps-admin-token"
START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0


def binaries() -> Path:
    out = subprocess.run(
        [str(ROOT / "hack" / "control-plane.sh"), "bin"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(state: Path, name: str, argv: list[str]) -> None:
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pids = state / "pids"
    pids.mkdir(exist_ok=True)
    (pids / name).write_text(str(proc.pid))


def _alive(state: Path, name: str) -> bool:
    pid = int((state / "pids" / name).read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (our child, exited) still answers kill(0): look at its state
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(state: Path, name: str, ready: object, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if not _alive(state, name):
            tail = (state / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"{name} exited while starting; the end of its log:\n{tail}")
        try:
            if ready():  # type: ignore[operator]
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(0.25)
    raise SystemExit(
        f"{name} did not become ready ({what}) in {START_TIMEOUT:.0f} s; "
        f"see {state / 'logs' / (name + '.log')}"
    )


def _get(url: str, *, token: str | None = None) -> tuple[int, bytes]:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as err:
        return int(err.code), b""


def up(state: Path, *, address: str = "127.0.0.1", node_pki: Path | None = None) -> str:
    """Starts the control plane; returns the API server's URL.

    `address` is where the API server listens and what it advertises (the `kubernetes`
    Service's endpoint). With `node_pki` (hack/node.py: a real kubelet), it also admits
    ServiceAccount tokens into pods, publishes its CA as kube-root-ca.crt, and reaches the
    kubelet over TLS with a client certificate, checking the kubelet's serving certificate.
    """
    bin_dir = binaries()
    missing = [
        b
        for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
        if not (bin_dir / b).exists()
    ]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not in {bin_dir}: run `make control-plane`")
    if shutil.which("openssl") is None:
        subprocess.run([str(ROOT / "hack" / "apt-install.sh"), "openssl"], check=True)
    state.mkdir(parents=True, exist_ok=True)
    pki = state / "pki"
    pki.mkdir(exist_ok=True)
    subprocess.run(
        ["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"], check=True, capture_output=True
    )
    (pki / "tokens.csv").write_text(f'{TOKEN},admin,admin,"system:masters"\n')
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    _start(
        state,
        "etcd",
        [
            str(bin_dir / "etcd"),
            "--data-dir",
            str(state / "etcd"),
            "--listen-client-urls",
            etcd_url,
            "--advertise-client-urls",
            etcd_url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",
            "--log-level",
            "warn",
        ],
    )
    _wait(state, "etcd", lambda: _get(f"{etcd_url}/health")[0] == 200, f"{etcd_url}/health")
    server = f"https://{address}:{api_port}"
    node_flags = (
        [
            f"--kubelet-client-certificate={node_pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={node_pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={node_pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
        ]
        if node_pki
        # no kubelet: pods are created by tests without their ServiceAccount's token
        else ["--disable-admission-plugins=ServiceAccount"]
    )
    _start(
        state,
        "kube-apiserver",
        [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={address}",
            f"--advertise-address={address}",
            f"--secure-port={api_port}",
            f"--cert-dir={pki}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            f"--service-account-issuer={server}",
            f"--service-account-key-file={pki / 'sa.key'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            *node_flags,
        ],
    )
    _wait(
        state,
        "kube-apiserver",
        lambda: _get(f"{server}/readyz", token=TOKEN)[0] == 200,
        f"{server}/readyz",
    )
    kubeconfig = state / "kubeconfig.tmp"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "jaxps",
                "clusters": [
                    {
                        "name": "jaxps",
                        # kube-apiserver's self-made serving certificate, its CA in the bundle
                        "cluster": {
                            "server": server,
                            "certificate-authority": str(pki / "apiserver.crt"),
                        },
                    }
                ],
                "users": [{"name": "admin", "user": {"token": TOKEN}}],
                "contexts": [{"name": "jaxps", "context": {"cluster": "jaxps", "user": "admin"}}],
            },
            indent=2,
        )
    )
    _start(
        state,
        "kube-controller-manager",
        [
            str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            # pods' kube-root-ca.crt: what an in-cluster client trusts the API server with
            f"--root-ca-file={pki / 'apiserver.crt'}",
            "--use-service-account-credentials=false",
            "--concurrent-gc-syncs=5",
            # a node silent for 20 s is NotReady (50 s by default): the e2e node's kubelet
            # renews its lease every 5 s (hack/node.py), and a lost node's test waits less
            "--node-monitor-grace-period=20s",
        ],
    )
    _start(
        state,
        "kube-scheduler",
        [
            str(bin_dir / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
        ],
    )
    # the service-account controller creating `default` shows kube-controller-manager works
    _wait(
        state,
        "kube-controller-manager",
        lambda: (
            _get(f"{server}/api/v1/namespaces/default/serviceaccounts/default", token=TOKEN)[0]
            == 200
        ),
        "the default ServiceAccount",
    )
    _wait(state, "kube-scheduler", lambda: True, "started")
    kubeconfig.rename(state / "kubeconfig")
    print(f"control plane up at {server}; KUBECONFIG={state / 'kubeconfig'}")
    return server


def down(state: Path, *, grace: float = STOP_TIMEOUT) -> None:
    """Stops the processes (SIGTERM, SIGKILL after `grace` seconds) and removes `state`: the
    API server and its clients first, etcd after them (an API server whose etcd went first
    spent 21 s of its shutdown retrying it; stopped before etcd, 1 s)."""
    pids = state / "pids"
    names = sorted(p.name for p in pids.iterdir()) if pids.is_dir() else []
    for batch in ([n for n in names if n != "etcd"], [n for n in names if n == "etcd"]):
        for name in batch:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int((pids / name).read_text()), signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in batch:
            while _alive(state, name) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(state, name):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int((pids / name).read_text()), signal.SIGKILL)
    shutil.rmtree(state, ignore_errors=True)
    print(f"control plane in {state} stopped" if names else f"no control plane in {state}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--dir", type=Path, default=ROOT / ".cluster")
    args = parser.parse_args()
    state = args.dir.resolve()
    if args.action == "up" and (state / "pids").exists():
        raise SystemExit(
            f"{state} holds a control plane: `python hack/cluster.py down --dir {state}` first"
        )
    try:
        up(state) if args.action == "up" else down(state)
    except BaseException:
        if args.action == "up":
            down(state)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
