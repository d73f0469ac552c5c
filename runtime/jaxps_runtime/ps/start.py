"""A ps's start-up before JAX loads: what `python -m jaxps_runtime` sets for a ps task, and a
standby ps that loads everything ahead and waits to become one.

A restarted ps is what every other task waits for, so its start is short: `prepare` tunes the
process (malloc, the compilation cache) through the environment JAX reads as it loads, and the
server then listens before it imports JAX (`server`), whose CPU backend it starts with the
ps's intra-op threads (`cluster.xla_threads`). Standard library only at import: a ps listens
before it imports jax, optax, yaml or prometheus_client (tests/unit/test_ps_start.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import IO

from jaxps_runtime.config import cluster
from jaxps_runtime.process import malloc, xla
from jaxps_runtime.process import standby as standby_process


def prepare(environ: MutableMapping[str, str], *, training_file: Path | None) -> None:
    """Sets up a ps process before JAX loads: malloc that keeps what a ps frees, the
    compilation cache in the job's checkpoint directory. Raises `cluster.ClusterSpecError` for
    a bad JAXPS_PS_XLA_THREADS."""
    # refused at start (before anything changes), not once listening
    cluster.xla_threads(environ, task_type=cluster.PS)
    _ps_malloc(environ)
    _ps_compilation_cache(
        environ, training_file=training_file, training_env=environ.get("JAXPS_TRAINING")
    )


def standby(*, training_file: Path | None, stdin: IO[str]) -> bool:
    """A ps that loads everything a ps loads (gRPC, JAX and its CPU backend, optax, the store),
    then waits to become one: JAXPS_STANDBY=ps.

    A restarted ps is what a whole job waits for, and importing JAX is most of its start
    (0.5-0.6 s of ~1 s on 2 cores). A launcher keeps one standby per job (`standby.Standby`)
    and hands it a ps that died: one JSON line on stdin, `{"env": {...}, "stdout": path,
    "stderr": path}`, whose env may set only what differs between two ps of the job (TASK_ENV;
    everything else JAX or the ps read at load, XLA_FLAGS included, came from the standby's own
    environment, the job's). True once this process is that task (its environment updated, its
    stdout and stderr sent to the files named): the caller then runs it as that task would.
    False at end of input, as when its launcher goes; `standby.StandbyError` for an assignment
    it cannot take.
    """
    prepare(os.environ, training_file=training_file)
    from jaxps_runtime.ps import server  # noqa: F401, PLC0415

    xla.start_cpu_backend(cluster.xla_threads(os.environ, task_type=cluster.PS) or 1)
    line = stdin.readline()
    if not line.strip():
        return False
    assignment = standby_process.assignment(line)
    for fd, path in ((1, assignment["stdout"]), (2, assignment["stderr"])):
        sys.stdout.flush()
        sys.stderr.flush()
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.update(assignment["env"])
    return True


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
    return malloc.tune(
        {malloc.M_MMAP_THRESHOLD: PS_MMAP_THRESHOLD, malloc.M_TRIM_THRESHOLD: PS_TRIM_THRESHOLD},
        environ,
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
    """The training configuration's checkpoint.dir, if it has one.

    Not `config.training`'s parsed configuration, on purpose: a ps needs no valid configuration
    (a worker reports a wrong one): JAXPS_TRAINING as the control planes write it, JSON, gives
    its directory however wrong the rest is, and is read without importing `config.training`
    (YAML, the catalog: tens of ms before a restarted ps listens). A file, or YAML in
    JAXPS_TRAINING, is parsed by `config.training`; no directory if it is invalid."""
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
