"""`python -m jaxps_runtime`: the command of every jaxps pod and local process.

The task comes from TF_CONFIG (TensorFlow's format) or from TF1's flags
(--ps_hosts --worker_hosts [--chief_hosts --evaluator_hosts] --job_name --task_index); the job's
identity from JAXPS_JOB_UID (or JAXPS_JOB_NAME). Exit codes: 0 done, 1 failed, 2 a usage error
(TF_CONFIG, the flags, JAXPS_LOG_LEVEL, JAXPS_METRICS_PORT, JAXPS_METRICS_ADDRESS,
JAXPS_PS_XLA_THREADS, JAXPS_XLA_THREADS), 78 an
invalid training configuration (`config.EXIT_INVALID_TRAINING`: the control plane fails the job
at once; the problems are in the termination log, see `roles`), 128 + N stopped by signal N
(143 for SIGTERM, 130 for SIGINT; a ps exits 0, see `server`).
Every role stops cleanly and promptly on SIGTERM and SIGINT (`stopping`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from jaxps_runtime.config import cluster
from jaxps_runtime.process import keeper, stopping, xla
from jaxps_runtime.process import standby as standby_process
from jaxps_runtime.ps import start
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


def standby(argv: Sequence[str], *, stdin: IO[str] = sys.stdin) -> int:
    """A ps loaded ahead, waiting to become one (JAXPS_STANDBY=ps, `start.standby`); once a
    launcher hands it a task, it runs as that task would (`main`). End of input, as when its
    launcher goes, ends it with 0; an assignment it cannot take ends it with EXIT_USAGE."""
    os.environ.pop(standby_process.STANDBY_ENV, None)
    args, _ = _arguments(argv)
    try:
        assigned = start.standby(training_file=args.training, stdin=stdin)
    except standby_process.StandbyError as err:
        print(f"jaxps_runtime: standby: {err}", file=sys.stderr)
        return EXIT_USAGE
    return main(argv, loaded=True) if assigned else 0


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
    try:
        config = task_config(rest, os.environ)
        _check_settings(args, os.environ, task_type=config.task.type)
    except cluster.ClusterSpecError as err:
        print(f"jaxps_runtime: {err}", file=sys.stderr)
        return EXIT_USAGE
    task = config.task
    if task.type == cluster.PS and not loaded and keeper.KEEPER_ENV in os.environ:
        for name in (keeper.KEEPER_ENV, cluster.PS_STANDBY_DELAY_ENV):
            problem = cluster.setting_problem(
                name, os.environ.get(name, "10"), task_type=cluster.PS
            )
            if problem:
                print(f"jaxps_runtime: {problem}", file=sys.stderr)
                return EXIT_USAGE
        if keeper.wanted(os.environ):  # the ps as its child, a standby beside it
            return keeper.run(argv, os.environ)
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
            start.prepare(os.environ, training_file=args.training)
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
    # JAXPS_XLA_THREADS (checked: _check_settings), else the container's CPU limit, before
    # anything starts XLA's CPU backend; neither: XLA's own pool, a thread per CPU
    threads = cluster.xla_threads(os.environ, task_type=task.type) or xla.cpu_limit()
    if threads is not None:
        xla.start_cpu_backend(threads)
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


def _check_settings(
    args: argparse.Namespace, environ: Mapping[str, str], *, task_type: str
) -> None:
    """The settings from the environment that a task of `task_type` reads (a ps's own are
    checked by `start.prepare`); a ClusterSpecError names the first wrong."""
    settings = {"JAXPS_BULK": environ.get("JAXPS_BULK", "on")}
    if args.log_level not in cluster.LOG_LEVELS:  # argparse checks the flag, not its default
        settings["JAXPS_LOG_LEVEL"] = environ.get("JAXPS_LOG_LEVEL", "")
    if "JAXPS_METRICS_ADDRESS" in environ:  # from valueFrom, unseen by the control plane
        settings["JAXPS_METRICS_ADDRESS"] = environ["JAXPS_METRICS_ADDRESS"]
    if cluster.XLA_THREADS_ENV in environ:  # a ps has its own, and reads no other
        settings[cluster.XLA_THREADS_ENV] = environ[cluster.XLA_THREADS_ENV]
    if cluster.LOOP_GRACE_ENV in environ:
        settings[cluster.LOOP_GRACE_ENV] = environ[cluster.LOOP_GRACE_ENV]
    for name, value in settings.items():
        problem = cluster.setting_problem(name, value, task_type=task_type)
        if problem:
            raise cluster.ClusterSpecError(problem)


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
