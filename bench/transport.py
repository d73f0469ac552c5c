"""How fast tensors move: raw TCP, raw grpcio, and jaxps update/read of a 64 MiB pytree.

Prints one JSON object per measurement (DEVELOPERS.md format). Every server runs in its own
process on 127.0.0.1, like a ps would. jaxps rows (`jaxps-push/pull-…`: the bulk path, as a
worker moves tensors) have raw TCP in the same run as their baseline: a socket that sends one
buffer and `recv_into`s another, nothing else; `ratio` = jaxps MB/s / raw TCP MB/s. The
`jaxps-grpc-…` rows are jaxps with the bulk path off (every call on gRPC), against raw grpcio:
a generic handler moving raw 1 MiB byte chunks into a preallocated array (push) or out of one
(pull), with no protobuf at all. jaxps push includes applying the gradient on the ps (SGD).

What mutual TLS costs the bulk path, and its floor: `sealed-records-…` moves the same buffer
through the bulk path's AES-128-GCM records (`wire.bulk.sealed`, as after the TLS handover)
against raw TCP, both ends' CPU milliseconds per MB (the sender's and the receiver's process
together); `aes-gcm-…` is the sealing itself on one core, 1 MiB records, the same record
again (in the cache) or record after record from memory, against a memory copy of as many
bytes.

    python bench/transport.py [--repeats 5] [--mib 64]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.process.harness

import grpc
import numpy as np
import results
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from proc import cpu_seconds

from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient
from jaxps_runtime.config import cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.wire import rpc
from jaxps_runtime.wire.bulk import sealed
from tests.process import harness

CHUNK = 1 << 20
BENCH = "transport"


def emit(case: str, **kwargs: Any) -> None:
    results.emit(BENCH, case, **kwargs)


def timed_median(fn: Callable[[], None], *, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- servers (run as `transport.py --serve-tcp/--serve-grpc PORT NBYTES`) --------------------


def serve_tcp(port: int, nbytes: int, *, seal: bool = False) -> None:
    """Reads NBYTES per connection into one buffer, answers one byte; with `seal`, through the
    bulk path's sealed records (`sealed_end`'s server end)."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", port)) as server:
        print("ready", flush=True)
        while True:
            bare, _ = server.accept()
            conn = sealed_end(bare, server=True) if seal else bare
            with conn:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")


def serve_grpc(port: int, nbytes: int) -> None:
    """Raw-bytes push (client stream into an array) and pull (server stream out of one)."""
    target = np.zeros(nbytes // 4, np.float32)
    flat = target.view(np.uint8)
    source = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    src = memoryview(source.view(np.uint8))

    def push(chunks: Iterator[bytes], _ctx: grpc.ServicerContext) -> bytes:
        offset = 0
        for chunk in chunks:
            flat[offset : offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
            offset += len(chunk)
        return b"ok"

    def pull(_request: bytes, _ctx: grpc.ServicerContext) -> Iterator[bytes]:
        for offset in range(0, nbytes, CHUNK):
            yield src[offset : offset + CHUNK].tobytes()

    server = grpc.server(futures.ThreadPoolExecutor(8), options=list(rpc.SERVER_OPTIONS))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "raw.Raw",
                {
                    "Push": grpc.stream_unary_rpc_method_handler(push),
                    "Pull": grpc.unary_stream_rpc_method_handler(pull),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def sealed_end(bare: socket.socket, *, server: bool) -> sealed.Sealed:
    """One end of a connection in the bulk path's AES-128-GCM records, under fixed keys (what
    `sealed.hand_over` does once TLS has agreed them; the handshake is not what is measured)."""
    keys = {True: AESGCM(b"s" * 16), False: AESGCM(b"c" * 16)}
    return sealed.Sealed(bare, sealing=keys[server], opening=keys[not server])


def start_server(kind: str, nbytes: int) -> tuple[subprocess.Popen[bytes], int]:
    port = cluster.free_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, __file__, f"--serve-{kind}", str(port), str(nbytes)],
        stdout=subprocess.PIPE,
        env=harness.runtime_env(),
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"{kind} server did not start")
    return proc, port


# --- measurements -----------------------------------------------------------------------------


def measure_tcp(nbytes: int, repeats: int) -> float:
    proc, port = start_server("tcp", nbytes)
    payload = memoryview(np.ones(nbytes, np.uint8))
    try:

        def once() -> None:
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(payload)
                conn.recv(1)

        return nbytes / timed_median(once, repeats=repeats) / 1e6
    finally:
        proc.kill()
        proc.wait()


def measure_cpu_per_mb(nbytes: int, repeats: int, *, seal: bool) -> tuple[float, float]:
    """CPU milliseconds per MB moved over loopback TCP, sender and receiver together, and MB/s:
    a sender that `sendall`s one buffer per connection, a receiver that `recv_into`s one; with
    `seal`, both in sealed records."""
    proc, port = start_server("sealed" if seal else "tcp", nbytes)
    payload = memoryview(np.ones(nbytes, np.uint8))
    try:

        def once() -> None:
            with socket.create_connection(("127.0.0.1", port)) as bare:
                conn = sealed_end(bare, server=False) if seal else bare
                conn.sendall(payload)
                conn.recv(1)

        once()  # warm up
        cpu = time.process_time(), cpu_seconds(proc.pid)
        started = time.perf_counter()
        for _ in range(repeats):
            once()
        seconds = time.perf_counter() - started
        used = time.process_time() - cpu[0] + cpu_seconds(proc.pid) - cpu[1]
        megabytes = nbytes * repeats / 1e6
        return used / megabytes * 1e3, megabytes / seconds
    finally:
        proc.kill()
        proc.wait()


def aes_gcm_rates(nbytes: int) -> dict[str, float]:
    """GB/s of sealing 1 MiB records (`cryptography`'s AESGCM, as the bulk path does): within
    the cache (the same record again), and from `nbytes` of memory into one record buffer; and
    of copying `nbytes` of memory (numpy) for scale."""
    aead = AESGCM(b"k" * 16)
    nonce = bytes(12)
    source = np.ones(nbytes, np.uint8)
    view = memoryview(source)
    record = bytearray(CHUNK + 16)

    def rate(fn: Callable[[], None], total: int) -> float:
        fn()
        started = time.process_time()
        fn()
        return total / (time.process_time() - started) / 1e9

    def in_cache() -> None:
        for _ in range(nbytes // CHUNK):
            aead.encrypt_into(nonce, view[:CHUNK], b"", record)

    def from_memory() -> None:
        for offset in range(0, nbytes, CHUNK):
            aead.encrypt_into(nonce, view[offset : offset + CHUNK], b"", record)

    target = np.empty_like(source)
    return {
        "aes-gcm-in-cache": rate(in_cache, nbytes),
        "aes-gcm-from-memory": rate(from_memory, nbytes),
        "memory-copy": rate(lambda: np.copyto(target, source), nbytes),
    }


def measure_raw_grpc(nbytes: int, repeats: int) -> tuple[float, float]:
    proc, port = start_server("grpc", nbytes)
    data = np.random.default_rng(1).standard_normal(nbytes // 4).astype(np.float32)
    mv = memoryview(data.view(np.uint8))
    out = np.empty(nbytes // 4, np.float32)
    out_flat = out.view(np.uint8)
    try:
        with rpc.channel(f"127.0.0.1:{port}") as channel:
            push = channel.stream_unary("/raw.Raw/Push")
            pull = channel.unary_stream("/raw.Raw/Pull")
            grpc.channel_ready_future(channel).result(timeout=30)

            def push_once() -> None:
                push(mv[o : o + CHUNK].tobytes() for o in range(0, nbytes, CHUNK))

            def pull_once() -> None:
                offset = 0
                for chunk in pull(b""):
                    out_flat[offset : offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    offset += len(chunk)

            push_rate = nbytes / timed_median(push_once, repeats=repeats) / 1e6
            pull_rate = nbytes / timed_median(pull_once, repeats=repeats) / 1e6
            return push_rate, pull_rate
    finally:
        proc.kill()
        proc.wait()


def measure_jaxps(nbytes: int, num_ps: int, repeats: int, *, use_bulk: bool) -> tuple[float, float]:
    leaves = 8
    rows = nbytes // leaves // 4 // 2048
    rng = np.random.default_rng(2)
    tree = {
        f"layer{i}": rng.standard_normal((rows, 2048)).astype(np.float32) for i in range(leaves)
    }
    grads = {k: np.full_like(v, 1e-3) for k, v in tree.items()}
    _, named = placement.named_leaves(tree)
    _, named_grads = placement.named_leaves(grads)
    ps = harness.LocalPs.start(num_ps, job_id="bench")
    try:
        layout = placement.plan(placement.variables_of(tree), num_ps=num_ps)
        with PsClient(
            addresses=ps.addresses,
            placement=layout,
            job_id="bench",
            task="worker-0",
            use_bulk=use_bulk,
        ) as client:
            client.init(
                named, optimizer=config.OptimizerConfig("sgd", {"learning_rate": 0.1}), epoch=1
            )
            step = 0

            def push_once() -> None:
                nonlocal step
                client.update(named_grads, step=step)
                step += 1

            push_rate = nbytes / timed_median(push_once, repeats=repeats) / 1e6
            # Like the raw baseline, pull into buffers allocated once (as a training loop does).
            _, buffers = client.read()

            def pull_once() -> None:
                client.read(into=buffers)

            pull_rate = nbytes / timed_median(pull_once, repeats=repeats) / 1e6
            client.shutdown(reason="bench done")
            return push_rate, pull_rate
    finally:
        ps.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--serve-tcp", nargs=2, type=int, metavar=("PORT", "NBYTES"))
    parser.add_argument("--serve-grpc", nargs=2, type=int, metavar=("PORT", "NBYTES"))
    parser.add_argument("--serve-sealed", nargs=2, type=int, metavar=("PORT", "NBYTES"))
    args = parser.parse_args()
    if args.serve_tcp or args.serve_sealed:
        serve_tcp(*(args.serve_tcp or args.serve_sealed), seal=bool(args.serve_sealed))
        return
    if args.serve_grpc:
        serve_grpc(*args.serve_grpc)
        return
    nbytes = args.mib << 20
    size = f"{args.mib}MiB"
    tcp = measure_tcp(nbytes, args.repeats)
    emit(f"raw-tcp-loopback-{size}", metric="throughput", value=tcp, unit="MB/s")
    raw_push, raw_pull = measure_raw_grpc(nbytes, args.repeats)
    rows = [  # (case, MB/s, baseline, its MB/s)
        (f"raw-grpcio-push-{size}", raw_push, "raw-tcp-loopback", tcp),
        (f"raw-grpcio-pull-{size}", raw_pull, "raw-tcp-loopback", tcp),
    ]
    for num_ps in (1, 2):
        push, pull = measure_jaxps(nbytes, num_ps, args.repeats, use_bulk=True)
        rows += [
            (f"jaxps-push-{size}-{num_ps}ps", push, "raw-tcp-loopback", tcp),
            (f"jaxps-pull-{size}-{num_ps}ps", pull, "raw-tcp-loopback", tcp),
        ]
    push, pull = measure_jaxps(nbytes, 1, args.repeats, use_bulk=False)
    rows += [
        (f"jaxps-grpc-push-{size}-1ps", push, "raw-grpcio-push", raw_push),
        (f"jaxps-grpc-pull-{size}-1ps", pull, "raw-grpcio-pull", raw_pull),
    ]
    for case, value, baseline, baseline_value in rows:
        emit(
            case,
            metric="throughput",
            value=value,
            unit="MB/s",
            baseline=baseline,
            baseline_value=baseline_value,
        )
    plain_cpu, plain_rate = measure_cpu_per_mb(nbytes, args.repeats, seal=False)
    sealed_cpu, sealed_rate = measure_cpu_per_mb(nbytes, args.repeats, seal=True)
    baseline = "raw-tcp-loopback, same run"
    emit(
        f"sealed-records-{size}",
        metric="CPU ms per MB moved, both ends",
        value=sealed_cpu,
        unit="ms/MB",
        baseline=baseline,
        baseline_value=plain_cpu,
        lower_is_better=True,
    )
    emit(
        f"sealed-records-{size}",
        metric="throughput",
        value=sealed_rate,
        unit="MB/s",
        baseline=baseline,
        baseline_value=plain_rate,
    )
    rates = aes_gcm_rates(nbytes)
    for case in ("aes-gcm-in-cache", "aes-gcm-from-memory"):
        emit(
            f"{case}-{size}",
            metric="sealing rate, one core",
            value=rates[case],
            unit="GB/s",
            baseline="memory copy (numpy), same run",
            baseline_value=rates["memory-copy"],
        )


if __name__ == "__main__":
    main()
