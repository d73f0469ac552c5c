"""`python -m jaxps_runtime`: the command of every jaxps pod and local process.

The task comes from TF_CONFIG (TensorFlow's format) or from TF1's flags
(--ps_hosts --worker_hosts [--chief_hosts --evaluator_hosts] --job_name --task_index); the job's
identity from JAXPS_JOB_UID (or JAXPS_JOB_NAME). Exit codes: 0 done, 1 failed, 2 a usage error
(TF_CONFIG, the flags, JAXPS_LOG_LEVEL, JAXPS_METRICS_PORT, JAXPS_METRICS_ADDRESS,
JAXPS_PS_XLA_THREADS), 78 an
invalid training configuration (`config.EXIT_INVALID_TRAINING`: the control plane fails the job
at once; the problems are in the termination log, see `roles`), 128 + N stopped by signal N
(143 for SIGTERM, 130 for SIGINT; a ps exits 0, see `server`).
Every role stops cleanly and promptly on SIGTERM and SIGINT (`stopping`).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import IO

from jaxps_runtime.config import cluster
from jaxps_runtime.process import standby as standby_process
from jaxps_runtime.process import stopping
from jaxps_runtime.wire.credentials import CredentialsError, Identity, TaskCredentials

EXIT_USAGE = 2
log = logging.getLogger("jaxps_runtime")


def _arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m jaxps_runtime",
        description="Runs one task (ps, worker, chief or evaluator) of a jaxps job.",
        epilog="The task comes from TF_CONFIG, or from TF1 flags: --ps_hosts --worker_hosts "
        "[--chief_hosts --evaluator_hosts] --job_name --task_index.",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,  # argparse applies it to the default (JAXPS_LOG_LEVEL) too
        default=os.environ.get("JAXPS_LOG_LEVEL", "INFO"),
        choices=cluster.LOG_LEVELS,
        help="default: JAXPS_LOG_LEVEL, else INFO (any case)",
    )
    parser.add_argument(
        "--bind",
        default=os.environ.get("JAXPS_BIND_ADDRESS"),
        help="host:port to listen on (default: the task's own address; all "
        "interfaces unless it is a loopback address)",
    )
    parser.add_argument(
        "--tls-dir",
        type=Path,
        default=os.environ.get("JAXPS_TLS_DIR") or None,
        help="the task's credentials (ca.crt, tls.crt, tls.key from its job's CA): mutual TLS "
        "with every peer (default: JAXPS_TLS_DIR; unset: plaintext, unprotected)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get("JAXPS_INSECURE", "").lower() in ("1", "true", "yes"),
        help="without credentials, run in plaintext: any peer that reaches the task may call "
        "it; only for a trusted network (default: JAXPS_INSECURE)",
    )
    parser.add_argument(
        "--training",
        type=Path,
        help="the training configuration as a JSON or YAML file (default: JAXPS_TRAINING)",
    )
    return parser.parse_known_args(argv)


def task_config(argv: Sequence[str], environ: Mapping[str, str]) -> cluster.TFConfig:
    """TF1 flags when given, else TF_CONFIG; a ClusterSpecError names what is wrong."""
    if any(a.startswith(("--job_name", "--ps_hosts", "--worker_hosts")) for a in argv):
        config, rest = cluster.parse_tf1_flags(argv)
        if rest:
            raise cluster.ClusterSpecError(f"unknown arguments: {' '.join(rest)}")
        return config
    config_or_none = cluster.from_env(environ)
    if config_or_none is None:
        raise cluster.ClusterSpecError(
            "no task given: set TF_CONFIG, or pass --ps_hosts, --worker_hosts, --job_name and "
            "--task_index"
        )
    if argv:
        raise cluster.ClusterSpecError(f"unknown arguments: {' '.join(argv)}")
    return config_or_none


def _ps_xla_threads(environ: MutableMapping[str, str]) -> None:
    """Runs a ps's XLA updates single-threaded unless JAXPS_PS_XLA_THREADS > 1, before jax loads.

    A ps's updates are element-wise and overlap with receiving the next shard; XLA's own
    intra-op threads then only compete with gRPC's threads for the cores. Measured with
    bench/transport.py on 2 cores: 64 MiB push through 1 ps 640 -> 1090 MB/s.

    XLA has no flag for a thread count (it sizes its pool from the CPUs the process may run
    on), so any count above 1 means XLA's multi-threaded default. Every token added to XLA_FLAGS
    is a `--flag`: XLA reads a first token without `--` as a file of flags and aborts the
    process when there is none.
    """
    threads = environ.get("JAXPS_PS_XLA_THREADS", "1")
    problem = cluster.setting_problem("JAXPS_PS_XLA_THREADS", threads, task_type=cluster.PS)
    if problem:
        raise cluster.ClusterSpecError(problem)
    if int(threads) == 1:
        environ["XLA_FLAGS"] = (
            f"{environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
        )


MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
PS_MMAP_THRESHOLD = 1 << 30
PS_TRIM_THRESHOLD = 2**31 - 1


def _ps_malloc(environ: Mapping[str, str]) -> bool:
    """Makes glibc's malloc keep the memory a ps frees for its next update, before jax loads;
    False where it did not (another libc, or the user tuned malloc in the environment).

    Every update of a shard makes new arrays (XLA's outputs: its values and optimizer state)
    and frees the last ones, megabytes each. glibc gives memory back to the system when the
    top of its heap is free (trim, from 128 KiB), and serves a large block with its own mmap;
    either way the next update's arrays are fresh pages, zeroed by the kernel on first touch.
    Measured on 2 cores with the 4.3M-parameter dense mlp (1 ps, 1 worker, async): ~3,500-4,000
    page faults and 38-45 ms of ps CPU per step; with these settings ~200 and 29 ms. The cost:
    a ps's resident memory stays at its peak rather than shrinking between updates (as
    TensorFlow's allocator never shrinks either).
    """
    if any(name in environ for name in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, PS_MMAP_THRESHOLD)
        and mallopt(M_TRIM_THRESHOLD, PS_TRIM_THRESHOLD)
    )


COMPILATION_CACHE = "compilation-cache"


def _ps_compilation_cache(
    environ: MutableMapping[str, str], *, training_file: Path | None, training_env: str | None
) -> None:
    """Keeps the programs a ps compiles (each shard shape's optimizer update, the optimizer
    state's first values) in `compilation-cache/` of the job's checkpoint directory, before jax
    loads: a restarted ps, which the whole job waits for, then reads them instead of compiling
    them again (bench/recovery.py on 2 cores: its restore 140 -> 75 ms, its first update
    135 -> 30 ms). The checkpoint directory is what a replaced pod finds again; one
    subdirectory per CPU kind, as a program compiled for one instruction set may not run on
    another.

    Left alone when JAX_COMPILATION_CACHE_DIR is set already (the user's choice; and
    JAX_ENABLE_COMPILATION_CACHE=false turns it off); none without a checkpoint directory."""
    if "JAX_COMPILATION_CACHE_DIR" in environ:
        return
    checkpoints = _checkpoint_dir(training_file=training_file, training_env=training_env)
    if checkpoints is None:
        return
    directory = Path(checkpoints) / COMPILATION_CACHE / _cpu_kind()
    environ["JAX_COMPILATION_CACHE_DIR"] = str(directory)
    # every program: a ps's are small and quick to compile, but each is on the recovery path
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _checkpoint_dir(*, training_file: Path | None, training_env: str | None) -> str | None:
    """The training configuration's checkpoint.dir, if it has one. A ps needs no valid
    configuration (a worker reports a wrong one), so nothing else is checked; and JAXPS_TRAINING
    as the control planes write it, JSON, is read without `config` (YAML, the catalog: tens of
    ms before a restarted ps listens)."""
    if training_file is None:
        if training_env is None:
            return None
        try:
            raw = json.loads(training_env)
        except ValueError:
            pass  # YAML, which `config` reads
        else:
            checkpoint = raw.get("checkpoint") if isinstance(raw, dict) else None
            directory = checkpoint.get("dir") if isinstance(checkpoint, dict) else None
            return directory if isinstance(directory, str) and directory else None
    from jaxps_runtime.config import training as config  # noqa: PLC0415

    try:
        if training_file is not None:
            training = config.load(training_file)
        else:
            training = config.loads(training_env or "", path="JAXPS_TRAINING")
    except config.TrainingConfigError:
        return None
    return training.checkpoint.dir or None


def _cpu_kind() -> str:
    """The machine and its instruction set extensions, as a short name."""
    features = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            features = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        features = platform.processor()
    digest = hashlib.sha256(" ".join(sorted(features.split())).encode()).hexdigest()
    return f"{platform.machine() or 'cpu'}-{digest[:12]}"


def standby(argv: Sequence[str], *, stdin: IO[str] = sys.stdin) -> int:
    """A ps that has loaded everything a ps loads (gRPC, JAX and its CPU backend, optax, the
    store), waiting to become one: `python -m jaxps_runtime` with JAXPS_STANDBY=ps.

    A restarted ps is what a whole job waits for, and importing JAX is most of its start
    (0.5-0.6 s of ~1 s on 2 cores). A launcher keeps one standby per job (`standby.Standby`)
    and hands it a ps that died: one JSON line on stdin, `{"env": {...}, "stdout": path,
    "stderr": path}`, whose env may set only what differs between two ps of the job (TASK_ENV;
    everything else JAX or the ps read at load, XLA_FLAGS included, came from the standby's own
    environment, the job's). It then runs as that task would (`main`). End of input, as when
    its launcher goes, ends it with 0; an assignment it cannot take ends it with EXIT_USAGE.
    """
    os.environ.pop(standby_process.STANDBY_ENV, None)
    args, _ = _arguments(argv)
    _ps_malloc(os.environ)
    _ps_xla_threads(os.environ)
    _ps_compilation_cache(
        os.environ, training_file=args.training, training_env=os.environ.get("JAXPS_TRAINING")
    )
    import jax  # noqa: PLC0415

    from jaxps_runtime.ps import server  # noqa: F401, PLC0415

    jax.devices()  # the CPU backend, with the ps's XLA_FLAGS
    line = stdin.readline()
    if not line.strip():
        return 0
    try:
        assignment = standby_process.assignment(line)
    except standby_process.StandbyError as err:
        print(f"jaxps_runtime: standby: {err}", file=sys.stderr)
        return EXIT_USAGE
    for fd, path in ((1, assignment["stdout"]), (2, assignment["stderr"])):
        sys.stdout.flush()
        sys.stderr.flush()
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.update(assignment["env"])
    return main(argv, loaded=True)


def main(argv: Sequence[str] | None = None, *, loaded: bool = False) -> int:
    """Runs the task; `loaded`: a standby's, whose ps set-up before JAX's import is done."""
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(standby_process.STANDBY_ENV):
        if os.environ[standby_process.STANDBY_ENV] != cluster.PS:
            print(
                f"jaxps_runtime: {standby_process.STANDBY_ENV}: got "
                f"{os.environ[standby_process.STANDBY_ENV]!r}; allowed: ps",
                file=sys.stderr,
            )
            return EXIT_USAGE
        return standby(argv)
    args, rest = _arguments(argv)
    settings = {"JAXPS_BULK": os.environ.get("JAXPS_BULK", "on")}
    if args.log_level not in cluster.LOG_LEVELS:  # argparse checks the flag, not its default
        settings["JAXPS_LOG_LEVEL"] = os.environ.get("JAXPS_LOG_LEVEL", "")
    if "JAXPS_METRICS_ADDRESS" in os.environ:  # from valueFrom, unseen by the control plane
        settings["JAXPS_METRICS_ADDRESS"] = os.environ["JAXPS_METRICS_ADDRESS"]
    for name, value in settings.items():
        problem = cluster.setting_problem(name, value, task_type="")
        if problem:
            print(f"jaxps_runtime: {problem}", file=sys.stderr)
            return EXIT_USAGE
    try:
        config = task_config(rest, os.environ)
    except cluster.ClusterSpecError as err:
        print(f"jaxps_runtime: {err}", file=sys.stderr)
        return EXIT_USAGE
    task = config.task
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s {task.name} %(name)s: %(message)s",
    )
    if loaded:
        log.info("%s: started from the job's standby, loaded ahead", task.name)
    # Before anything slow (jax's import): from here on a signal stops the task cleanly.
    stop = stopping.Stop()
    stopping.install(stop)
    job_id = os.environ.get("JAXPS_JOB_UID") or os.environ.get("JAXPS_JOB_NAME") or "jaxps"
    try:
        if loaded and task.type != cluster.PS:
            raise cluster.ClusterSpecError(f"a ps standby cannot be {task.type} {task.index}")
        if task.type == cluster.PS and not loaded:
            _ps_malloc(os.environ)
            _ps_xla_threads(os.environ)
            _ps_compilation_cache(
                os.environ,
                training_file=args.training,
                training_env=os.environ.get("JAXPS_TRAINING"),
            )
        metrics_port = _metrics_port(os.environ)
        credentials = _credentials(args.tls_dir, task=task, job_id=job_id, insecure=args.insecure)
    except (cluster.ClusterSpecError, CredentialsError) as err:
        print(f"jaxps_runtime: {err}", file=sys.stderr)
        return EXIT_USAGE
    if task.type == cluster.PS:
        # Straight to its server, which listens before it loads JAX (`server`): a restarted ps
        # is what every other task waits for.
        from jaxps_runtime.ps import server  # noqa: PLC0415

        return server.run(
            spec=config,
            job_id=job_id,
            bind=args.bind,
            metrics_port=metrics_port,
            stop=stop,
            credentials=credentials,
        )
    # Imported here: jax must see XLA_FLAGS first, and `--help` and errors stay fast.
    from jaxps_runtime import roles  # noqa: PLC0415

    return roles.run(
        spec=config,
        job_id=job_id,
        bind=args.bind,
        training_file=args.training,
        training_env=os.environ.get("JAXPS_TRAINING"),
        metrics_port=metrics_port,
        stop=stop,
        credentials=credentials,
    )


def _credentials(
    directory: Path | None, *, task: cluster.TaskSpec, job_id: str, insecure: bool
) -> TaskCredentials | None:
    """The task's credentials, which must name this very task of this job. None only when
    told so (`insecure`), with a warning: every channel is then plaintext and unauthenticated."""
    if directory is None:
        if not insecure:
            raise CredentialsError(
                "no credentials: give the task its certificate with --tls-dir DIR (or "
                "JAXPS_TLS_DIR: ca.crt, tls.crt, tls.key of its job's CA), or run it in "
                "plaintext on a trusted network with --insecure (or JAXPS_INSECURE=1)"
            )
        log.warning(
            "%s: no credentials (--tls-dir, JAXPS_TLS_DIR): task-to-task traffic is PLAINTEXT "
            "and any peer that reaches this task can call it; only for a trusted network",
            task.name,
        )
        return None
    loaded = TaskCredentials.load(directory)
    named = loaded.identity()
    if named != Identity(job=job_id, role=task.type, index=task.index):
        raise CredentialsError(
            f"--tls-dir {directory}: the certificate is for {named}; this task is "
            f"{task.type} {task.index} of job {job_id}"
        )
    return loaded


def _metrics_port(environ: Mapping[str, str]) -> int:
    raw = environ.get("JAXPS_METRICS_PORT", "9090")
    if not (raw.isascii() and raw.isdigit()) or int(raw) > 65535:
        raise cluster.ClusterSpecError(
            f"JAXPS_METRICS_PORT: got {raw!r}; expected a port 0..65535 (0: pick a free one)"
        )
    return int(raw)


if __name__ == "__main__":
    sys.exit(main())
