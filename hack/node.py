"""A real one-node Kubernetes cluster on this machine, for `make cluster-up` and the e2e tier.

    python hack/node.py up   [--dir DIR] [--image TAR ...]   control plane (hack/cluster.py) on
                                                            the bridge address, containerd, the
                                                            kubelet, CoreDNS and kube-proxy;
                                                            imports the image tarballs
    python hack/node.py up   --with-jaxps [--dir DIR]        the same, with both jaxps images
                                                            built (hack/image.py) and imported,
                                                            and the operator installed with the
                                                            Helm chart (`make cluster-up`)
    python hack/node.py up   --with-kueue [--dir DIR]        the same, with Kueue v0.17.0 built
                                                            from its module, imported and
                                                            installed (hack/kueue.py); alone or
                                                            with --with-jaxps (Kueue goes first)
    python hack/node.py down [--dir DIR]                    stops every process it started and
                                                            removes its pods, mounts, cgroups,
                                                            interfaces, iptables chains, state;
                                                            puts back the sysctls it changed
    python hack/node.py kubelet-stop|kubelet-start [--dir DIR]
                                                            the kubelet alone, stopped (its pods'
                                                            containers run on) and started again:
                                                            a lost node, and its return

What it runs (research/real-node.md is the trial it follows):
- a bridge `jaxps0` with 10.88.0.1/16: the pod network (CNI bridge + host-local), the node's IP
  and where the API server, the kubelet and CoreDNS listen. Nothing is masqueraded, and two
  FORWARD rules drop whatever would cross between the bridge and any other interface: all pod
  traffic stays on this machine. CoreDNS serves cluster.local only (no upstream).
- containerd (Debian's, with `restrict_oom_score_adj`: this VM withholds CAP_SYS_RESOURCE), its
  socket, root and state under DIR; a static `pause` image built here with gcc.
- the kubelet (cgroupfs, cgroup v1, oomScoreAdj 0), serving TLS with a certificate of the node's
  CA and accepting only client certificates of that CA (the API server's) and webhook-checked
  tokens; kube-proxy in iptables mode, so ClusterIP Services (the `kubernetes` one included)
  route.

`up` writes DIR/phases.json, the seconds of each part (node, kueue, jaxps), for the e2e tier's
record. Kueue runs as a pod in kueue-system, so `down` removes it with every other pod.

One node per machine: the ports are fixed (10250, 10248, 10256, 10249, 10.88.0.1:53) and so is
the bridge. `up` refuses while another node runs and cleans up after a node whose owner died.
Needs root. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster
import kueue

ROOT = Path(__file__).resolve().parent.parent
BRIDGE = "jaxps0"
GATEWAY = "10.88.0.1"
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"
PAUSE_IMAGE = "localhost/jaxps/pause:3.10"
# Where the running node is recorded: one per machine, whatever DIR it uses.
OWNER = Path("/run/jaxps-node.json")
# Sysctls that the bridge plugin, the kubelet or kube-proxy may change: put back at `down`.
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.netfilter.nf_conntrack_max",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
FORWARD_RULES = (
    ["-i", BRIDGE, "!", "-o", BRIDGE],
    ["-o", BRIDGE, "!", "-i", BRIDGE],
)
APT_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "conntrack")
STEP_TIMEOUT = 120.0

PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void stop(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  signal(SIGINT, stop); signal(SIGTERM, stop); signal(SIGCHLD, reap);
  for (;;) pause();
}
"""


def log(message: str) -> None:
    print(f"[node] {message}", file=sys.stderr, flush=True)


def run(
    argv: list[str], *, check: bool = True, quiet: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, text=True, capture_output=quiet)


def node_name() -> str:
    return socket.gethostname().lower()


# ---------------------------------------------------------------------------- configuration


def _pki(state: Path) -> Path:
    """The node's CA, the kubelet's serving certificate and the API server's client one."""
    pki = state / "node-pki"
    pki.mkdir(parents=True, exist_ok=True)

    def key_and_csr(name: str, subject: str) -> None:
        run(["openssl", "genrsa", "-out", str(pki / f"{name}.key"), "2048"])
        run(
            [
                "openssl",
                "req",
                "-new",
                "-key",
                str(pki / f"{name}.key"),
                "-subj",
                subject,
                "-out",
                str(pki / f"{name}.csr"),
            ]
        )

    run(["openssl", "genrsa", "-out", str(pki / "ca.key"), "2048"])
    run(
        [
            "openssl",
            "req",
            "-x509",
            "-new",
            "-key",
            str(pki / "ca.key"),
            "-days",
            "2",
            "-subj",
            "/CN=jaxps-node-ca",
            "-out",
            str(pki / "ca.crt"),
        ]
    )
    for name, subject, extensions in (
        (
            "kubelet",
            f"/CN={node_name()}",
            f"subjectAltName=IP:{GATEWAY},DNS:{node_name()}\nextendedKeyUsage=serverAuth\n",
        ),
        (
            "apiserver-kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            "extendedKeyUsage=clientAuth\n",
        ),
    ):
        key_and_csr(name, subject)
        (pki / f"{name}.ext").write_text(extensions)
        run(
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                str(pki / f"{name}.csr"),
                "-days",
                "2",
                "-CA",
                str(pki / "ca.crt"),
                "-CAkey",
                str(pki / "ca.key"),
                "-CAcreateserial",
                "-extfile",
                str(pki / f"{name}.ext"),
                "-out",
                str(pki / f"{name}.crt"),
            ]
        )
    for key in pki.glob("*.key"):
        key.chmod(0o600)
    return pki


def _write_configs(state: Path, *, kubeconfig: Path) -> None:
    etc = state / "etc"
    (etc / "cni").mkdir(parents=True, exist_ok=True)
    sock = state / "containerd.sock"
    (etc / "containerd.toml").write_text(f"""version = 2
root = "{state}/containerd/root"
state = "{state}/containerd/state"
[grpc]
  address = "{sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{state}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # this VM withholds CAP_SYS_RESOURCE: nothing may lower oom_score_adj below containerd's own
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{etc}/cni"
""")
    (etc / "cni" / "10-jaxps.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "0.4.0",
                "name": "jaxps",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        "isGateway": True,
                        "ipMasq": False,
                        "hairpinMode": True,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                            "dataDir": str(state / "cni-ipam"),
                        },
                    }
                ],
            },
            indent=2,
        )
    )
    pki = state / "node-pki"
    (etc / "resolv.conf").write_text("")  # pods learn no name server of the host
    (etc / "kubelet.json").write_text(
        json.dumps(
            {
                "apiVersion": "kubelet.config.k8s.io/v1beta1",
                "kind": "KubeletConfiguration",
                "containerRuntimeEndpoint": f"unix://{sock}",
                "cgroupDriver": "cgroupfs",
                "failSwapOn": False,
                "failCgroupV1": False,
                # CAP_SYS_RESOURCE is withheld: the kubelet may not lower its own score
                "oomScoreAdj": 0,
                "address": GATEWAY,
                "port": 10250,
                "readOnlyPort": 0,
                # a heartbeat every 5 s (a quarter of the lease): the control plane takes the
                # node for lost 20 s after the last (--node-monitor-grace-period, hack/cluster.py)
                "nodeLeaseDurationSeconds": 20,
                "healthzBindAddress": "127.0.0.1",
                "healthzPort": 10248,
                "tlsCertFile": str(pki / "kubelet.crt"),
                "tlsPrivateKeyFile": str(pki / "kubelet.key"),
                "authentication": {
                    "anonymous": {"enabled": False},
                    "webhook": {"enabled": True},
                    "x509": {"clientCAFile": str(pki / "ca.crt")},
                },
                "authorization": {"mode": "Webhook"},
                "clusterDNS": [GATEWAY],
                "clusterDomain": "cluster.local",
                "resolvConf": str(etc / "resolv.conf"),
                "podLogsDir": str(state / "pod-logs"),
                # imported images cannot be pulled again: never collect them
                "imageGCHighThresholdPercent": 100,
                "imageGCLowThresholdPercent": 99,
                "evictionHard": {
                    "memory.available": "100Mi",
                    "nodefs.available": "1%",
                    "nodefs.inodesFree": "1%",
                    "imagefs.available": "1%",
                },
                "serializeImagePulls": False,
                "syncFrequency": "10s",
                "fileCheckFrequency": "10s",
                "nodeStatusUpdateFrequency": "5s",
                "staticPodPath": "",
            },
            indent=2,
        )
    )
    (etc / "kube-proxy.json").write_text(
        json.dumps(
            {
                "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                "kind": "KubeProxyConfiguration",
                "clientConnection": {"kubeconfig": str(kubeconfig)},
                "mode": "iptables",
                "hostnameOverride": node_name(),
                "clusterCIDR": POD_CIDR,
                "healthzBindAddress": "127.0.0.1:10256",
                "metricsBindAddress": "127.0.0.1:10249",
                # NodePorts only on the bridge address, never on the machine's own interfaces
                "nodePortAddresses": [f"{GATEWAY}/32"],
                "conntrack": {
                    "maxPerCore": 0,
                    "min": 0,
                    "tcpEstablishedTimeout": "0s",
                    "tcpCloseWaitTimeout": "0s",
                },
                "iptables": {"localhostNodePorts": False},
            },
            indent=2,
        )
    )
    (etc / "Corefile").write_text(f""".:53 {{
    bind {GATEWAY}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} jaxps
        pods insecure
        ttl 5
    }}
    loadbalance
}}
""")


# ---------------------------------------------------------------------------- processes


def _start(state: Path, name: str, argv: list[str]) -> None:
    cluster._start(state, name, argv)


def _wait(state: Path, name: str, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline:
        if not cluster._alive(state, name):
            tail = (state / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"{name} exited while starting; the end of its log:\n{tail}")
        with contextlib.suppress(
            OSError, urllib.error.URLError, ValueError, subprocess.SubprocessError
        ):
            if ready():
                return
        time.sleep(0.25)
    raise SystemExit(
        f"{name} not ready ({what}) in {STEP_TIMEOUT:.0f} s; see {state}/logs/{name}.log"
    )


def _ctr(state: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["ctr", "-a", str(state / "containerd.sock"), "-n", "k8s.io", *args], check=check)


def _kubectl(state: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    kubectl = cluster.binaries() / "kubectl"
    return run([str(kubectl), f"--kubeconfig={state / 'kubeconfig'}", *args], check=check)


def _pause_image(state: Path) -> Path:
    """A static pause binary as a one-layer image: the sandbox of every pod."""
    sys.path.insert(0, str(ROOT / "hack"))
    import image  # noqa: PLC0415  (hack/image.py: the OCI layout writer)

    work = state / "pause"
    rootfs = work / "rootfs"
    rootfs.mkdir(parents=True, exist_ok=True)
    (work / "pause.c").write_text(PAUSE_C)
    run(
        [
            "gcc",
            "-Os",
            "-static",
            "-include",
            "sys/wait.h",
            "-o",
            str(rootfs / "pause"),
            str(work / "pause.c"),
        ]
    )
    run(["strip", str(rootfs / "pause")])
    tar = work / "pause.tar"
    config = {
        "architecture": image.host_arch(),
        "os": "linux",
        "config": {"Entrypoint": ["/pause"]},
    }
    image.write_oci_archive(rootfs=rootfs, archive=tar, ref=PAUSE_IMAGE, config=config)
    return tar


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _record_sysctls(state: Path) -> None:
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = _sysctl_path(name).read_text().strip()
    (state / "sysctls.json").write_text(json.dumps(values, indent=2))


def _iptables_chains() -> set[tuple[str, str, str]]:
    """(binary, table, chain) of every KUBE-/CNI- chain that exists now."""
    chains = set()
    for binary in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            out = run([f"{binary}-save", "-t", table], check=False).stdout
            for line in out.splitlines():
                if line.startswith(":") and line[1:].startswith(("KUBE-", "CNI-")):
                    chains.add((binary, table, line[1:].split()[0]))
    return chains


def up(state: Path, images: list[Path]) -> None:
    if os.geteuid() != 0:
        raise SystemExit("the node needs root (containerd, the kubelet, a bridge, iptables)")
    _claim(state)
    t0 = time.monotonic()
    subprocess.run(
        [str(ROOT / "hack" / "apt-install.sh"), *APT_PACKAGES, "openssl", "gcc"], check=True
    )
    bin_dir = cluster.binaries()
    missing = [b for b in ("kubelet", "kube-proxy", "coredns") if not (bin_dir / b).exists()]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not in {bin_dir}: run `hack/control-plane.sh node`")
    state.mkdir(parents=True, exist_ok=True)
    _record_sysctls(state)
    (state / "iptables-before.json").write_text(json.dumps(sorted(_iptables_chains())))
    if run(["ip", "link", "show", BRIDGE], check=False).returncode != 0:
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{GATEWAY}/16", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
    for rule in FORWARD_RULES:
        run(
            [
                "iptables",
                "-I",
                "FORWARD",
                "1",
                *rule,
                "-m",
                "comment",
                "--comment",
                "jaxps-node",
                "-j",
                "DROP",
            ]
        )
    pki = _pki(state)
    server = cluster.up(state, address=GATEWAY, node_pki=pki)
    kubeconfig = state / "kubeconfig"
    _write_configs(state, kubeconfig=kubeconfig)
    log(f"control plane up in {time.monotonic() - t0:.1f} s")
    _start(state, "containerd", ["containerd", "--config", str(state / "etc" / "containerd.toml")])
    _wait(state, "containerd", lambda: _ctr(state, "version").returncode == 0, "ctr version")
    for tar in [_pause_image(state), *images]:
        t = time.monotonic()
        _ctr(state, "images", "import", str(tar))  # unpacked now: the first pod waits less
        log(f"imported {tar.name} in {time.monotonic() - t:.1f} s")
    start_kubelet(state)
    _start(state, "coredns", [str(bin_dir / "coredns"), "-conf", str(state / "etc" / "Corefile")])
    _wait(
        state,
        "coredns",
        lambda: _dns_answers("kubernetes.default.svc.cluster.local"),
        "DNS answers",
    )
    _start(
        state,
        "kube-proxy",
        [str(bin_dir / "kube-proxy"), f"--config={state / 'etc' / 'kube-proxy.json'}"],
    )
    _wait(
        state,
        "kube-proxy",
        lambda: cluster._get("http://127.0.0.1:10256/healthz")[0] == 200,
        "127.0.0.1:10256/healthz",
    )
    log(f"node {node_name()} up in {time.monotonic() - t0:.1f} s at {server}")
    print(f"KUBECONFIG={kubeconfig}")


def start_kubelet(state: Path) -> None:
    """Starts the node's kubelet and waits until the node is Ready (at `up`, and again after
    `kubelet-stop`: a test of a lost node stops it and brings it back)."""
    bin_dir = cluster.binaries()
    kubeconfig = state / "kubeconfig"
    _start(
        state,
        "kubelet",
        [
            str(bin_dir / "kubelet"),
            f"--config={state / 'etc' / 'kubelet.json'}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={state / 'kubelet'}",
            f"--node-ip={GATEWAY}",
            f"--hostname-override={node_name()}",
            "--v=1",
        ],
    )
    _wait(
        state,
        "kubelet",
        lambda: (
            "True"
            in _kubectl(
                state,
                "get",
                "node",
                node_name(),
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                check=False,
            ).stdout
        ),
        f"node {node_name()} Ready",
    )


def _dns_answers(name: str) -> bool:
    """One A query to CoreDNS on the bridge; True when it answers with an address."""
    query = (
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
        + b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
        + b"\x00\x00\x01\x00\x01"
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.0)
        s.sendto(query, (GATEWAY, 53))
        reply = s.recv(512)
    return len(reply) > 12 and reply[3] & 0x0F == 0 and int.from_bytes(reply[6:8], "big") > 0


# ---------------------------------------------------------------------------- ownership


def _claim(state: Path) -> None:
    """One node per machine: refuse while another one runs, clean up one whose owner died."""
    if OWNER.exists():
        other = Path(json.loads(OWNER.read_text())["dir"])
        if (
            other.exists()
            and (other / "pids" / "kubelet").exists()
            and cluster._alive(other, "kubelet")
        ):
            raise SystemExit(
                f"a node already runs from {other}: `python hack/node.py down --dir {other}` first"
            )
        log(f"cleaning up the node left in {other}")
        down(other)
    OWNER.write_text(json.dumps({"dir": str(state), "pid": os.getpid()}))


# ---------------------------------------------------------------------------- down


def _processes_under(cgroup_root: str) -> set[int]:
    pids: set[int] = set()
    base = Path("/sys/fs/cgroup/pids") / cgroup_root
    if base.is_dir():
        for procs in base.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in procs.read_text().split())
    return pids


def _stop(state: Path, name: str) -> None:
    pid_file = state / "pids" / name
    if not pid_file.exists():
        return
    with contextlib.suppress(ProcessLookupError, ValueError):
        os.killpg(int(pid_file.read_text()), signal.SIGTERM)
    deadline = time.monotonic() + 15
    while cluster._alive(state, name) and time.monotonic() < deadline:
        time.sleep(0.1)
    if cluster._alive(state, name):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    pid_file.unlink()


def _remove_containers(state: Path) -> None:
    """Kills every task of our containerd and deletes its containers (sandboxes included)."""
    if not (state / "pids" / "containerd").exists() or not cluster._alive(state, "containerd"):
        return
    tasks = _ctr(state, "tasks", "ls", "-q", check=False).stdout.split()
    for task in tasks:
        _ctr(state, "tasks", "kill", "-s", "SIGKILL", task, check=False)
    for task in tasks:
        _ctr(state, "tasks", "delete", "-f", task, check=False)
    for container in _ctr(state, "containers", "ls", "-q", check=False).stdout.split():
        _ctr(state, "containers", "delete", container, check=False)


def _kill_leftovers(state: Path) -> None:
    """Shims of our socket and anything still in the pods' cgroups."""
    sock = str(state / "containerd.sock")
    victims = _processes_under("kubepods") | _processes_under("k8s.io")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "containerd-shim" in cmdline and sock in cmdline:
                victims.add(int(proc.name))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _mounts_under(state: Path) -> list[str]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == str(state) or point.startswith(f"{state}/"):
            mounts.append(point)
    return sorted(mounts, key=len, reverse=True)


def _remove_cgroups() -> None:
    for controller in Path("/sys/fs/cgroup").iterdir():
        for top in ("kubepods", "k8s.io"):
            base = controller / top
            if not base.is_dir():
                continue
            for d in sorted(
                (p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            ):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                base.rmdir()


def _remove_network(state: Path) -> None:
    for veth in run(
        ["ip", "-o", "link", "show", "master", BRIDGE], check=False
    ).stdout.splitlines():
        name = veth.split(":")[1].strip().split("@")[0]
        run(["ip", "link", "delete", name], check=False)
    run(["ip", "link", "delete", BRIDGE], check=False)
    for rule in FORWARD_RULES:
        comment = ["-m", "comment", "--comment", "jaxps-node", "-j", "DROP"]
        while run(["iptables", "-D", "FORWARD", *rule, *comment], check=False).returncode == 0:
            pass
    before_file = state / "iptables-before.json"
    before = (
        {tuple(c) for c in json.loads(before_file.read_text())} if before_file.exists() else set()
    )
    ours = _iptables_chains() - before
    # rules elsewhere that jump to our chains go first, then the chains themselves
    for binary in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            names = {c for b, t, c in ours if (b, t) == (binary, table)}
            if not names:
                continue
            for line in run([f"{binary}-save", "-t", table], check=False).stdout.splitlines():
                parts = line.split()
                if (
                    line.startswith("-A ")
                    and parts[1] not in names
                    and any(n in parts for n in names)
                ):
                    run([binary, "-t", table, "-D", *parts[1:]], check=False)
            for name in names:
                run([binary, "-t", table, "-F", name], check=False)
            for name in names:
                run([binary, "-t", table, "-X", name], check=False)


def _restore_sysctls(state: Path) -> None:
    saved = state / "sysctls.json"
    if not saved.exists():
        return
    for name, value in json.loads(saved.read_text()).items():
        with contextlib.suppress(OSError):
            if _sysctl_path(name).read_text().strip() != value:
                _sysctl_path(name).write_text(value)


def down(state: Path) -> None:
    if not state.exists():
        log(f"no node in {state}")
        return
    for name in ("kube-proxy", "kubelet"):
        _stop(state, name)
    _remove_containers(state)
    _kill_leftovers(state)
    for name in ("coredns", "containerd"):
        _stop(state, name)
    _kill_leftovers(state)
    if (state / "etc" / "kube-proxy.json").exists():
        run(
            [
                str(cluster.binaries() / "kube-proxy"),
                "--cleanup",
                f"--config={state / 'etc' / 'kube-proxy.json'}",
            ],
            check=False,
        )
    for point in _mounts_under(state):
        run(["umount", "-l", point], check=False)
    _remove_cgroups()
    _remove_network(state)
    _restore_sysctls(state)
    # the control plane, and the state directory; the API server takes a minute to drain on
    # SIGTERM, and nothing of its state is kept
    cluster.down(state, grace=3.0)
    if OWNER.exists() and json.loads(OWNER.read_text())["dir"] == str(state):
        OWNER.unlink()
    log(f"node in {state} stopped; nothing left behind")


def build_image(name: str) -> tuple[str, Path]:
    """hack/image.py's build of docker/<name>.Dockerfile: its ref and tarball (cached)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "image.py"), "build", name, "--json"],
        check=True,
        text=True,
        stdout=subprocess.PIPE,
    )
    out = json.loads(done.stdout)
    return str(out["ref"]), Path(out["tar"])


def install_jaxps(state: Path) -> None:
    """Both images into the node and the chart's operator running in-cluster."""
    refs = {}
    for name in ("runtime", "operator"):
        refs[name], tar = build_image(name)
        t = time.monotonic()
        _ctr(state, "images", "import", str(tar))  # unpacked now: the first pod waits less
        log(f"imported {refs[name]} in {time.monotonic() - t:.1f} s")
    helm = cluster.binaries() / "helm"
    values = []
    for key, name in (("image", "operator"), ("runtimeImage", "runtime")):
        repository, tag = refs[name].rsplit(":", 1)
        values += ["--set", f"{key}.repository={repository}", "--set", f"{key}.tag={tag}"]
    release = [str(helm), "upgrade", "--install", "jaxps", str(ROOT / "charts" / "jaxps")]
    target = [f"--kubeconfig={state / 'kubeconfig'}", "--namespace", "jaxps-system"]
    run(
        [*release, *target, "--create-namespace", "--wait", "--timeout=5m", *values],
        quiet=False,
    )
    log("the jaxps operator runs in namespace jaxps-system")


def install_kueue(state: Path) -> float:
    """Kueue v0.17.0 (hack/kueue.py) imported into this node's containerd and ready to admit;
    returns the seconds it took."""

    def import_image(tar: Path) -> None:
        _ctr(state, "images", "import", str(tar))

    seconds = kueue.install(state=state, kubeconfig=state / "kubeconfig", import_image=import_image)
    return seconds["total"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "action",
        choices=("up", "down", "kubelet-stop", "kubelet-start"),
        help="kubelet-stop and kubelet-start: the node's kubelet alone (its pods' containers "
        "run on), as a lost node's would stop answering, and back",
    )
    parser.add_argument("--dir", type=Path, default=ROOT / ".cluster")
    parser.add_argument(
        "--image", type=Path, action="append", default=[], help="an OCI tarball to import"
    )
    parser.add_argument(
        "--with-jaxps", action="store_true", help="build and import both images, install the chart"
    )
    parser.add_argument(
        "--with-kueue", action="store_true", help="build, import and install Kueue v0.17.0"
    )
    args = parser.parse_args()
    state = args.dir.resolve()
    if args.action == "down":
        down(state)
        return 0
    if args.action == "kubelet-stop":
        _stop(state, "kubelet")
        log("kubelet stopped")
        return 0
    if args.action == "kubelet-start":
        started = time.monotonic()
        start_kubelet(state)
        log(f"kubelet started: node {node_name()} Ready in {time.monotonic() - started:.1f} s")
        return 0
    if (state / "pids").exists():
        raise SystemExit(f"{state} holds a cluster: `python hack/node.py down --dir {state}` first")
    try:
        started = time.monotonic()
        up(state, args.image)
        phases = {"node": round(time.monotonic() - started, 1)}
        # Kueue first: its CRDs exist before the operator starts
        if args.with_kueue:
            phases["kueue"] = install_kueue(state)
        if args.with_jaxps:
            started = time.monotonic()
            install_jaxps(state)
            phases["jaxps"] = round(time.monotonic() - started, 1)
        (state / "phases.json").write_text(json.dumps(phases))
    except BaseException:
        down(state)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
