"""hack/image.py without root or a network: the Dockerfile reader (each directive it carries
over, and an error naming the line for anything it does not understand) and the OCI image-layout
writer on a tiny rootfs (digests consistent, the ref annotated, the layer faithful)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_image_module() -> ModuleType:
    """hack/ is not a package: load image.py by path, registered in sys.modules because
    dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location("jaxps_hack_image", ROOT / "hack" / "image.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


image = _load_image_module()

BUILD_STAGE = """\
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY operator operator
RUN pip install --no-cache-dir --prefix=/install '.[runtime]'
"""
FINAL_HEAD = """\
FROM python:3.11-slim
COPY --from=build /install /usr/local
"""


def dockerfile(*final: str) -> str:
    """A Dockerfile with the jaxps build stage and these lines after the final stage's COPY."""
    return BUILD_STAGE + "\n" + FINAL_HEAD + "".join(line + "\n" for line in final)


def final_line(index: int) -> int:
    """The 1-based line number of final[index] in dockerfile(*final)."""
    return (BUILD_STAGE + "\n" + FINAL_HEAD).count("\n") + 1 + index


def parse(text: str) -> Any:
    """The ImageSpec of a Dockerfile text."""
    return image.parse_dockerfile(text, "Dockerfile")


# ---------------------------------------------------------------------------------------------
# The repo's Dockerfiles


def test_runtime_dockerfile() -> None:
    spec = image.parse_dockerfile((ROOT / "docker/runtime.Dockerfile").read_text(), "runtime")
    assert spec.extra == "runtime"
    assert spec.env["JAX_PLATFORMS"] == "cpu"
    assert spec.env["PYTHONUNBUFFERED"] == "1"
    assert spec.env["PATH"].startswith("/opt/venv/bin:")
    assert spec.user == "65532:65532"
    assert spec.ports == ["2222/tcp", "9090/tcp"]
    assert spec.entrypoint == ["python", "-m", "jaxps_runtime"]
    assert spec.cmd is None  # ENTRYPOINT cleared python:3.11-slim's CMD, as in Docker


def test_operator_dockerfile() -> None:
    spec = image.parse_dockerfile((ROOT / "docker/operator.Dockerfile").read_text(), "operator")
    assert spec.extra == "operator"
    assert spec.user == "65532:65532"
    assert spec.entrypoint == ["jaxps"]
    assert spec.cmd == ["operator"]
    assert spec.ports == []


# ---------------------------------------------------------------------------------------------
# Each directive


def test_base_config_without_directives() -> None:
    spec = parse(dockerfile())
    assert spec.env == image.BASE_ENV
    assert spec.cmd == ["python3"]
    assert spec.entrypoint is None
    assert spec.user is None
    assert spec.workdir is None


def test_build_stage_extra() -> None:
    text = dockerfile().replace("'.[runtime]'", "'.[operator]'")
    assert parse(text).extra == "operator"


def test_env_forms_and_substitution() -> None:
    spec = parse(
        dockerfile(
            'ENV A=1 B="two words"',
            "ENV C three four",
            "ENV PATH=/x/bin:$PATH D=${A}b",
            "ENV A=2 E=$A",
        )
    )
    assert spec.env["B"] == "two words"
    assert spec.env["C"] == "three four"
    assert spec.env["PATH"] == "/x/bin:" + image.BASE_ENV["PATH"]
    assert spec.env["D"] == "1b"
    assert (spec.env["A"], spec.env["E"]) == ("2", "1")  # a line sees the env before it


def test_env_continuation_and_comments() -> None:
    spec = parse(dockerfile("ENV A=1 \\", "# a comment inside the continuation", "    B=2"))
    assert (spec.env["A"], spec.env["B"]) == ("1", "2")


def test_user() -> None:
    assert parse(dockerfile("USER 1000")).user == "1000"
    assert parse(dockerfile("USER 65532:65532")).user == "65532:65532"


def test_workdir_absolute_then_relative() -> None:
    spec = parse(dockerfile("WORKDIR /app", "WORKDIR sub/../data"))
    assert spec.workdir == "/app/data"


def test_expose() -> None:
    spec = parse(dockerfile("EXPOSE 2222 9090/udp", "EXPOSE 2222/tcp"))
    assert spec.ports == ["2222/tcp", "9090/udp"]


def test_entrypoint_exec_and_shell_forms() -> None:
    assert parse(dockerfile('ENTRYPOINT ["a", "b"]')).entrypoint == ["a", "b"]
    assert parse(dockerfile("ENTRYPOINT run me")).entrypoint == ["/bin/sh", "-c", "run me"]


def test_cmd_and_entrypoint_order() -> None:
    after = parse(dockerfile('ENTRYPOINT ["e"]', 'CMD ["c"]'))
    before = parse(dockerfile('CMD ["c"]', 'ENTRYPOINT ["e"]'))
    alone = parse(dockerfile('CMD ["c", "d"]'))
    assert (after.entrypoint, after.cmd) == (["e"], ["c"])
    assert (before.entrypoint, before.cmd) == (["e"], ["c"])  # set in this stage: kept
    assert (alone.entrypoint, alone.cmd) == (None, ["c", "d"])


def test_image_config() -> None:
    spec = parse(dockerfile("ENV K=v", "USER 7:8", "WORKDIR /w", "EXPOSE 1", 'ENTRYPOINT ["e"]'))
    config = image.image_config(spec, "amd64")
    assert config["architecture"] == "amd64"
    assert config["os"] == "linux"
    assert config["config"] == {
        "Env": [f"{key}={value}" for key, value in image.BASE_ENV.items()] + ["K=v"],
        "User": "7:8",
        "WorkingDir": "/w",
        "ExposedPorts": {"1/tcp": {}},
        "Entrypoint": ["e"],
    }


# ---------------------------------------------------------------------------------------------
# What it does not understand: an error naming the line


@pytest.mark.parametrize(
    "line",
    [
        "LABEL a=b",
        "RUN echo hi",
        "ARG VERSION",
        "ADD app.tar /app",
        "VOLUME /data",
        "HEALTHCHECK NONE",
        "STOPSIGNAL SIGINT",
        "SHELL /bin/bash",
        "ONBUILD RUN true",
        "COPY . /app",
        "COPY --from=build /install /opt",
        "USER nobody",
        "EXPOSE 8000-8010",
        "EXPOSE 80/icmp",
        "ENV A=${B:-default}",
        "ENV 1A=x",
        'CMD ["unterminated"',
        'ENTRYPOINT ["a", 1]',
        "FROM python:3.11-slim",
    ],
)
def test_final_stage_line_not_understood(line: str) -> None:
    with pytest.raises(image.DockerfileError, match=rf"^Dockerfile:{final_line(1)}: "):
        parse(dockerfile("ENV OK=1", line))


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        ("--no-cache-dir", "--upgrade", 6),
        ("'.[runtime]'", "'.[runtime]' extra-package", 6),
        ("'.[runtime]'", "jaxps", 6),
        ("--prefix=/install ", "", 6),
        ("COPY operator operator", "COPY docs docs", 5),
        ("COPY operator operator", "COPY --chown=1 operator operator", 5),
        ("COPY operator operator", "ENV A=1", 5),
        ("COPY operator operator", "RUN true", 5),
        ("'.[runtime]'\n", "'.[runtime]'\nRUN true\n", 7),
        ("WORKDIR /src", "ARG X", 2),
        ("FROM python:3.11-slim AS build", "FROM debian:12 AS build", 1),
        ("FROM python:3.11-slim AS build", "FROM --platform=amd64 python:3.11-slim", 1),
    ],
)
def test_build_stage_line_not_understood(old: str, new: str, line: int) -> None:
    text = dockerfile().replace(old, new, 1)
    assert text != dockerfile()
    with pytest.raises(image.DockerfileError, match=rf"^Dockerfile:{line}: "):
        parse(text)


def test_instruction_before_from_names_its_line() -> None:
    with pytest.raises(image.DockerfileError, match=r"^Dockerfile:2: ARG before the first FROM"):
        parse("# comment\nARG V=1\n" + dockerfile())


def test_missing_copy_names_the_final_from() -> None:
    text = dockerfile().replace("COPY --from=build /install /usr/local\n", "")
    line = BUILD_STAGE.count("\n") + 2
    with pytest.raises(image.DockerfileError, match=rf"^Dockerfile:{line}: .*never copies"):
        parse(text)


def test_third_stage_names_its_from() -> None:
    text = dockerfile() + "FROM python:3.11-slim\n"
    with pytest.raises(image.DockerfileError, match=rf"^Dockerfile:{final_line(0)}: 3 stages"):
        parse(text)


def test_continuation_past_the_end() -> None:
    with pytest.raises(image.DockerfileError, match=r"^Dockerfile:\d+: line continuation"):
        parse(dockerfile("ENV A=1 \\"))


# ---------------------------------------------------------------------------------------------
# The OCI image layout


def make_rootfs(root: Path) -> Path:
    """A tiny rootfs: a 0640 file, an executable, a symlink and a hardlink to it, and files under
    dev/ and tmp/ that must not reach the layer."""
    rootfs = root / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "hello").write_text("hello\n")
    (rootfs / "etc" / "hello").chmod(0o640)
    (rootfs / "usr" / "bin").mkdir(parents=True)
    tool = rootfs / "usr" / "bin" / "tool"
    tool.write_text("#!/bin/sh\necho tool\n")
    tool.chmod(0o755)
    os.link(tool, rootfs / "usr" / "bin" / "hard")
    (rootfs / "usr" / "bin" / "link").symlink_to("tool")
    for emptied in ("dev", "tmp"):
        (rootfs / emptied).mkdir()
        (rootfs / emptied / "leftover").write_text("x")
    return rootfs


def read_archive(path: Path) -> dict[str, bytes]:
    """Every regular file of a tar: name -> bytes."""
    with tarfile.open(path) as tar:
        files = {}
        for member in tar.getmembers():
            data = tar.extractfile(member) if member.isfile() else None
            if data is not None:
                files[member.name] = data.read()
    return files


def sha256(data: bytes) -> str:
    """sha256:<hex> of data."""
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def blob(files: dict[str, bytes], descriptor: dict[str, Any]) -> bytes:
    """The blob a descriptor points at, checked against the descriptor's digest and size."""
    data = files["blobs/" + descriptor["digest"].replace(":", "/", 1)]
    assert sha256(data) == descriptor["digest"]
    assert len(data) == descriptor["size"]
    return data


REF = "localhost/jaxps/test:0.1.0-0123456789ab"


def write(tmp_path: Path, name: str = "image.tar") -> tuple[Path, dict[str, bytes]]:
    """The archive of the tiny rootfs, and its files."""
    rootfs = tmp_path / "rootfs" if (tmp_path / "rootfs").exists() else make_rootfs(tmp_path)
    config = image.image_config(parse(dockerfile('ENTRYPOINT ["tool"]')), "amd64")
    archive = tmp_path / name
    image.write_oci_archive(rootfs=rootfs, archive=archive, ref=REF, config=config)
    return archive, read_archive(archive)


def test_oci_layout_digests_and_ref(tmp_path: Path) -> None:
    archive, files = write(tmp_path)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    assert index["schemaVersion"] == 2
    (entry,) = index["manifests"]
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == REF
    assert entry["annotations"]["io.containerd.image.name"] == REF
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    manifest = json.loads(blob(files, entry))
    assert manifest["mediaType"] == entry["mediaType"] == image.MANIFEST_TYPE
    config = json.loads(blob(files, manifest["config"]))
    (layer_descriptor,) = manifest["layers"]
    layer = blob(files, layer_descriptor)
    assert config["rootfs"] == {"type": "layers", "diff_ids": [sha256(layer)]}
    assert config["config"]["Entrypoint"] == ["tool"]
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert name == "blobs/" + sha256(data).replace(":", "/")
    assert not list(tmp_path.glob("*.layer"))  # the streamed layer file is gone
    assert archive.stat().st_size > len(layer)


def test_layer_keeps_modes_owners_and_links(tmp_path: Path) -> None:
    _, files = write(tmp_path)
    manifest_digest = json.loads(files["index.json"])["manifests"][0]["digest"]
    manifest = json.loads(files["blobs/" + manifest_digest.replace(":", "/")])
    layer = files["blobs/" + manifest["layers"][0]["digest"].replace(":", "/")]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {member.name: member for member in tar.getmembers()}
    assert list(members) == [
        "dev",
        "etc",
        "tmp",
        "usr",
        "etc/hello",
        "usr/bin",
        "usr/bin/hard",
        "usr/bin/link",
        "usr/bin/tool",
    ]
    assert members["etc/hello"].mode == 0o640
    assert members["usr/bin/hard"].mode == 0o755
    assert members["usr/bin/link"].issym()
    assert members["usr/bin/link"].linkname == "tool"
    assert members["usr/bin/tool"].islnk()
    assert members["usr/bin/tool"].linkname == "usr/bin/hard"
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members.values()} == {
        (os.getuid(), os.getgid(), "", "")
    }


def test_archive_is_deterministic(tmp_path: Path) -> None:
    first, _ = write(tmp_path, "first.tar")
    second, _ = write(tmp_path, "second.tar")
    assert first.read_bytes() == second.read_bytes()


# ---------------------------------------------------------------------------------------------
# Names and the cache


def test_plan_ref_and_tar(tmp_path: Path) -> None:
    plan = image.make_plan("runtime", cache=tmp_path)
    assert re.fullmatch(r"localhost/jaxps/runtime:\d+\.\d+\.\d+.*-[0-9a-f]{12}", plan.ref)
    assert not plan.ref.endswith(":latest")
    assert plan.tar == tmp_path / "images" / f"runtime-{plan.hash12}.tar"
    assert "hack/image.py" in plan.inputs
    assert "docker/runtime.Dockerfile" in plan.inputs


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for age, name in enumerate([f"runtime-{n:012x}.tar" for n in range(4)]):
        path = tmp_path / name
        path.write_text(name)
        os.utime(path, (1000 - age, 1000 - age))
    (tmp_path / "runtime-gpu-000000000000.tar").write_text("other image")
    image.prune(tmp_path, r"runtime-[0-9a-f]{12}\.tar")
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "runtime-000000000000.tar",
        "runtime-000000000001.tar",
        "runtime-gpu-000000000000.tar",
    ]


# ---------------------------------------------------------------------------------------------
# An image of one static binary


STATIC_REF = "localhost/kueue:v0.17.0"


def fake_binary(tmp_path: Path, content: bytes = b"\x7fELF static") -> Path:
    """A file standing in for a static binary, 0700 as a root-only build might leave it."""
    binary = tmp_path / "bin" / "manager"
    binary.parent.mkdir(exist_ok=True)
    binary.write_bytes(content)
    binary.chmod(0o700)
    return binary


def test_static_image_holds_only_the_binary_run_as_nonroot(tmp_path: Path) -> None:
    plan = image.make_static_plan(fake_binary(tmp_path), ref=STATIC_REF, cache=tmp_path / "cache")
    assert plan.tar == tmp_path / "cache" / "images" / f"kueue-{plan.hash12}.tar"
    assert image.build_static(plan) is False
    files = read_archive(plan.tar)
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == STATIC_REF
    manifest = json.loads(blob(files, entry))
    config = json.loads(blob(files, manifest["config"]))["config"]
    assert config["Entrypoint"] == ["/manager"]
    assert "Cmd" not in config
    assert config["User"] == "65532:65532"
    assert config["WorkingDir"] == "/"
    layer = blob(files, manifest["layers"][0])
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        (member,) = tar.getmembers()
        data = tar.extractfile(member)
        assert data is not None
        assert data.read() == b"\x7fELF static"
    assert member.name == "manager"
    assert member.mode == 0o755  # the nonroot user can run it
    assert not list((tmp_path / "cache" / "tmp").iterdir())  # scratch removed


def test_static_image_is_cached_by_the_binary_content(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = image.make_static_plan(fake_binary(tmp_path), ref=STATIC_REF, cache=cache)
    assert image.build_static(first) is False
    again = image.make_static_plan(fake_binary(tmp_path), ref=STATIC_REF, cache=cache)
    assert again.hash12 == first.hash12
    assert image.build_static(again) is True
    rebuilt = image.make_static_plan(fake_binary(tmp_path, b"v2"), ref=STATIC_REF, cache=cache)
    assert rebuilt.hash12 != first.hash12
    assert image.build_static(rebuilt) is False
    assert rebuilt.tar.is_file()


@pytest.mark.parametrize("ref", ["localhost/kueue", "localhost/kueue:latest"])
def test_static_image_needs_a_tag_other_than_latest(tmp_path: Path, ref: str) -> None:
    with pytest.raises(SystemExit, match="name a tag"):
        image.make_static_plan(fake_binary(tmp_path), ref=ref, cache=tmp_path)
