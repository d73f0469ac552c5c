"""A ps's start, which a ps restart puts on every task's critical path: it listens before it
loads JAX, holds the calls that arrive meanwhile, and keeps what it compiles where its
replacement finds it."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from jaxps_runtime.config import cluster
from jaxps_runtime.process import malloc, xla
from jaxps_runtime.ps import server
from jaxps_runtime.ps import start as main
from tests.unit import imports


class AbortError(Exception):
    pass


class Context:
    """The part of a grpc.ServicerContext the stand-in uses."""

    def __init__(self, *, remaining: float = 10.0) -> None:
        self.deadline = time.monotonic() + remaining
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def time_remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise AbortError(details)


class Servicer:
    def Status(self, request: Any, context: Any) -> str:  # noqa: N802 (the RPC's name)
        return f"status of {request}"


def test_a_ps_listens_before_it_imports_jax_or_anything_else_it_can_load_later() -> None:
    later = ("jax", "optax", "jaxps_runtime.ps.store", "prometheus_client", "yaml")
    code = "from jaxps_runtime import __main__\nfrom jaxps_runtime.ps import server"
    assert imports.loaded_by(code, later) == []


def test_a_call_before_the_store_is_loaded_waits_for_it_then_runs_on_it() -> None:
    loading = server.Loading("ps-0", methods=["Status"])
    threading.Timer(0.05, loading.serve, args=(Servicer(),)).start()
    assert loading.Status("ps-0", Context()) == "status of ps-0"


def test_once_loaded_calls_go_straight_to_the_servicer() -> None:
    loading = server.Loading("ps-0", methods=["Status"])
    loading.serve(Servicer())
    loading.stop()  # the calls in flight while it stops still run, as before
    assert loading.Status("ps-0", Context(remaining=0.0)) == "status of ps-0"


def test_a_call_that_cannot_wait_any_longer_ends_unavailable_which_callers_retry() -> None:
    loading = server.Loading("ps-0", methods=["Status"])
    context = Context(remaining=0.05)
    with pytest.raises(AbortError):
        loading.Status("ps-0", context)
    assert context.aborted == (grpc.StatusCode.UNAVAILABLE, "ps-0 is starting")


def test_a_ps_stopped_while_loading_ends_the_calls_that_wait() -> None:
    loading = server.Loading("ps-0", methods=["Status"])
    threading.Timer(0.05, loading.stop).start()
    context = Context(remaining=30.0)
    started = time.monotonic()
    with pytest.raises(AbortError):
        loading.Status("ps-0", context)
    assert context.aborted == (grpc.StatusCode.UNAVAILABLE, "ps-0 is stopping")
    assert time.monotonic() - started < 5


def test_a_call_without_a_deadline_waits_a_bounded_time() -> None:
    """grpc says such a call has ~forever left; no wait can take that."""
    loading = server.Loading("ps-0", methods=["Status"])
    threading.Timer(0.05, loading.serve, args=(Servicer(),)).start()
    assert loading.Status("ps-0", Context(remaining=1e12)) == "status of ps-0"


def test_the_stand_in_has_only_the_methods_it_stands_in_for() -> None:
    loading = server.Loading("ps-0", methods=["Status"])
    assert callable(loading.Status)
    assert not hasattr(loading, "Shutdown")


def _training(**checkpoint: object) -> str:
    return json.dumps({"model": {"name": "mlp"}, "checkpoint": checkpoint})


def test_a_ps_keeps_its_compiled_programs_in_the_checkpoint_directory() -> None:
    environ: dict[str, str] = {}
    main._ps_compilation_cache(environ, training_file=None, training_env=_training(dir="/ckpt"))
    cache = Path(environ["JAX_COMPILATION_CACHE_DIR"])
    assert cache.parent == Path("/ckpt") / main.COMPILATION_CACHE
    assert cache.name == main._cpu_kind()  # one directory per instruction set
    assert environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


@pytest.mark.parametrize(
    "training",
    [
        pytest.param("checkpoint: {dir: /ckpt}\nmodel: {name: mlp}\n", id="yaml"),
        pytest.param(_training(dir="/ckpt", everySteps="often"), id="json-invalid-elsewhere"),
    ],
)
def test_the_checkpoint_directory_is_found_in_yaml_too_and_nothing_else_is_checked(
    training: str,
) -> None:
    environ: dict[str, str] = {}
    main._ps_compilation_cache(environ, training_file=None, training_env=training)
    assert Path(environ["JAX_COMPILATION_CACHE_DIR"]).parent == Path("/ckpt/compilation-cache")


def test_a_training_file_gives_the_checkpoint_directory(tmp_path: Path) -> None:
    file = tmp_path / "training.yaml"
    file.write_text("checkpoint:\n  dir: /from-file\n")
    environ: dict[str, str] = {}
    main._ps_compilation_cache(environ, training_file=file, training_env=_training(dir="/env"))
    assert Path(environ["JAX_COMPILATION_CACHE_DIR"]).parent.parent == Path("/from-file")


def test_a_compilation_cache_the_user_chose_is_left_alone() -> None:
    environ = {"JAX_COMPILATION_CACHE_DIR": "/mine"}
    main._ps_compilation_cache(environ, training_file=None, training_env=_training(dir="/ckpt"))
    assert environ == {"JAX_COMPILATION_CACHE_DIR": "/mine"}


@pytest.mark.parametrize(
    "training",
    [
        pytest.param(None, id="no-training-configuration"),
        pytest.param(_training(), id="no-checkpoint-directory"),
        pytest.param("{steps: [", id="unreadable-configuration"),
        pytest.param(json.dumps({"checkpoint": {"dir": 3}}), id="not-a-directory"),
    ],
)
def test_without_a_checkpoint_directory_a_ps_keeps_no_compilation_cache(
    training: str | None,
) -> None:
    environ: dict[str, str] = {}
    main._ps_compilation_cache(environ, training_file=None, training_env=training)
    assert environ == {}


def test_a_ps_tunes_malloc_to_keep_what_it_frees_unless_the_user_tuned_it() -> None:
    # glibc (this machine, the image): the settings are taken; a fresh interpreter, so that
    # this one's malloc is left as it was
    assert imports.run("from jaxps_runtime.ps import start as m\nprint(m._ps_malloc({}))") == "True"
    for name in malloc.MALLOC_ENV:
        assert main._ps_malloc({name: "x"}) is False


def test_a_ps_updates_on_one_xla_thread_unless_told_otherwise() -> None:
    assert cluster.xla_threads({}, task_type="ps") == 1
    assert cluster.xla_threads({"JAXPS_PS_XLA_THREADS": "4"}, task_type="ps") == 4
    # GLIBC_TUNABLES: the user tuned malloc, so this process's malloc is left as it was
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "GLIBC_TUNABLES": ""}
    main.prepare(environ, training_file=None)
    assert environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"  # the user's, and nothing added


@pytest.mark.parametrize("threads", ["0", "-1", "two", "", "²", "1.5"])
def test_a_bad_ps_thread_count_is_refused_naming_the_variable(threads: str) -> None:
    calls: list[Callable[[dict[str, str]], object]] = [
        lambda env: cluster.xla_threads(env, task_type="ps"),
        lambda env: main.prepare(env, training_file=None),
    ]
    for call in calls:
        with pytest.raises(
            cluster.ClusterSpecError,
            match=re.escape(f"JAXPS_PS_XLA_THREADS: got {json.dumps(threads)}"),
        ):
            call({"JAXPS_PS_XLA_THREADS": threads, "GLIBC_TUNABLES": ""})


@pytest.mark.parametrize("threads", [1, 2, 64])
def test_xla_starts_with_the_intra_op_threads_asked_and_every_thread_may_use_every_cpu(
    threads: int,
) -> None:
    """XLA sizes its pool from the starting thread's CPUs (no flag does it); each of its
    threads, and the thread that started it, may then run on any CPU the process may."""
    code = (
        "import os\n"
        "from jaxps_runtime.process import xla\n"
        f"xla.start_cpu_backend({threads})\n"
        "import jax\n"
        "assert int(jax.jit(lambda x: x + 1)(41)) == 42\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in tasks]\n"
        "cpus = {len(os.sched_getaffinity(int(t))) for t in tasks}\n"
        "print(names.count('tf_XLAEigen'), sorted(cpus))"
    )
    pool, cpus = imports.run(code).splitlines()[-1].split(" ", 1)
    allowed = len(os.sched_getaffinity(0))
    assert int(pool) == min(threads, allowed)
    assert cpus == f"[{allowed}]"


def cgroup_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("cgroups", "files", "cpus"),
    [
        # cgroup v2 in a container (its own cgroup at the root): limits.cpu 1500m
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        # v2 on a host: the pod's cgroup, its container's, the tighter one wins
        (
            "0::/kubepods/pod1/c1\n",
            {"kubepods/pod1/cpu.max": "400000 100000", "kubepods/pod1/c1/cpu.max": "max 100000"},
            4,
        ),
        ("0::/a\n", {"a/cpu.max": "50000 100000"}, 1),  # half a CPU: one thread
        # v1 without a cgroup namespace: /proc names the host's path, the mount is the pod's
        (
            "4:cpu,cpuacct:/kubepods/pod1/c1\n3:memory:/x\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            3,
        ),
        (
            "1:cpu:/\n",
            {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
            None,
        ),
        ("0::/\n", {"cpu.max": "garbage"}, None),
        ("0::/\n", {}, None),
    ],
)
def test_a_tasks_cpu_limit_is_read_from_its_cgroup(
    tmp_path: Path, cgroups: str, files: dict[str, str], cpus: int | None
) -> None:
    root = cgroup_tree(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text(cgroups)
    assert xla.cpu_limit(cgroups=tmp_path / "cgroup", root=root) == cpus


def test_no_cpu_limit_where_the_cgroup_cannot_be_read(tmp_path: Path) -> None:
    assert xla.cpu_limit(cgroups=tmp_path / "missing", root=tmp_path) is None
