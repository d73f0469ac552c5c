"""Build the jaxps container images locally, without a registry or a Docker daemon.

    python3 hack/image.py build runtime|operator [--json]   build the image tarball, or reuse it
    python3 hack/image.py ref runtime|operator              print the ref a build would give
    python3 hack/image.py static BINARY --ref REF [--json]  a one-layer image of a static binary

docker/<name>.Dockerfile stays the definition (what `docker build` users get). This script reads
it and reproduces it where python:3.11-slim cannot be pulled: the base is a Debian bookworm minbase
rootfs from mmdebstrap with python3 and a venv at /opt/venv (its bin dir first on PATH, as
/usr/local/bin is in python:3.11-slim); the build stage's `pip install '.[<extra>]'` becomes wheels
built on the host (whose pip knows the package index) installed offline into that venv; the final
stage's ENV, USER, WORKDIR, EXPOSE, ENTRYPOINT and CMD become the image config. A Dockerfile line
it cannot reproduce is an error naming the line, never skipped.

The result is an OCI image-layout tarball (one uncompressed layer) for `ctr -n k8s.io images
import`, named localhost/jaxps/<name>:<version>-<hash12>, where hash12 covers every input (the
Dockerfile, pyproject.toml, README.md, the files git would ship under runtime/ and operator/, and
this script). Outputs live in ${JAXPS_CACHE:-${XDG_CACHE_HOME:-~/.cache}/jaxps}: images/ (the 2
newest tarballs per name), base/ (the Debian rootfs, keyed by its own recipe, so a code change does
not re-run mmdebstrap) and tmp/ (scratch of running builds). Building needs root (mmdebstrap
--mode=root, chroot) and the repo's .venv; reusing a built tarball needs neither. Progress goes to
stderr, the answer to stdout. Standard library only.

`static` makes an image of a prebuilt static binary with no Dockerfile (Kueue's manager: its
Dockerfile's final stage is distroless/static, which cannot be pulled here): one layer holding the
binary at /<its name>, run as 65532:65532 from /, under the ref given, cached as
images/<name>-<hash12>.tar by the binary's content. It needs neither root nor the .venv.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import posixpath
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parent.parent
USAGE = "Build the jaxps container images locally (no registry, no Docker daemon)."
NAMES = ("runtime", "operator")
KEEP = 2
VENV = "/opt/venv"

# python:3.11-slim as seen by the Dockerfile's final stage: its config (PATH, LANG, CMD), with the
# venv standing in for /usr/local, where the build stage's `--prefix` install is copied to.
BASE_IMAGE = "python:3.11-slim"
BASE_ENV = {
    "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
BASE_CMD = ["python3"]
PREFIX_TARGET = "/usr/local"

# The base rootfs recipe: a change here is a new base key (base/<key>), so a new mmdebstrap run.
DEBIAN_SUITE = "bookworm"
DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
MMDEBSTRAP = (
    "mmdebstrap",
    "--mode=root",
    "--variant=minbase",
    "--include=python3,python3-venv,ca-certificates",
    # the host's mirror may be a snapshot whose Release files are past their Valid-Until
    '--aptopt=Acquire::Check-Valid-Until "false"',
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    f'--customize-hook=chroot "$1" python3 -m venv {VENV}',
    '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
    # mmdebstrap copies the host's resolv.conf and hostname in; an image must not carry them
    '--customize-hook=rm -f "$1"/etc/resolv.conf "$1"/etc/hostname',
)
# The environment of the pip run inside the chroot: none of the host's PIP_* settings (they name
# host paths) and no index at all, only the wheels built on the host.
CHROOT_ENV = {
    "PATH": f"{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}

# What a build stage may COPY: the files this script hashes and stages for pip.
SOURCE_FILES = ("pyproject.toml", "README.md")
SOURCE_TREES = ("runtime", "operator")
# pip options in the Dockerfile's RUN that do not change what is installed.
PIP_OPTIONS = frozenset(
    {"--no-cache-dir", "--quiet", "-q", "--disable-pip-version-check", "--root-user-action=ignore"}
)
# Directories whose contents never go into the layer: the runtime mounts its own there.
EMPTIED_DIRS = frozenset({"dev", "proc", "sys", "tmp"})
ARCHES = {"x86_64": "amd64", "aarch64": "arm64"}

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def _log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the answer (one JSON object with --json)."""
    print(f"image: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The Dockerfile


class DockerfileError(ValueError):
    """A Dockerfile line this script cannot reproduce; the message names the file and the line, so
    a change to the Dockerfile is either carried over or refused, never silently dropped."""


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined, with where it starts (for errors)."""

    source: str
    line: int
    keyword: str
    value: str

    def error(self, message: str) -> DockerfileError:
        """An error naming this instruction's file and line, like a compiler's."""
        return DockerfileError(f"{self.source}:{self.line}: {message}")


@dataclass(frozen=True)
class Stage:
    """A FROM (with its image and AS name) and the instructions up to the next FROM."""

    start: Instruction
    base: str
    name: str | None
    body: tuple[Instruction, ...] = ()


@dataclass
class ImageSpec:
    """What the image gets from its Dockerfile: the build stage's pip extra and the final stage's
    config, starting from python:3.11-slim's config as Docker's final stage does."""

    extra: str = ""
    env: dict[str, str] = field(default_factory=lambda: dict(BASE_ENV))
    user: str | None = None
    workdir: str | None = None
    ports: list[str] = field(default_factory=list)
    entrypoint: list[str] | None = None
    cmd: list[str] | None = field(default_factory=lambda: list(BASE_CMD))


def read_instructions(text: str, source: str) -> list[Instruction]:
    """Docker's line syntax: comments and blank lines dropped (also inside a continuation), a
    trailing backslash joins the next line, the keyword is case-insensitive."""
    result: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        start = start if pending else number
        pending.append(stripped.removesuffix("\\").strip())
        if stripped.endswith("\\"):
            continue
        keyword, _, value = " ".join(pending).partition(" ")
        pending = []
        ins = Instruction(source, start, keyword.upper(), value.strip())
        if not ins.value:
            raise ins.error(f"{ins.keyword} without arguments")
        result.append(ins)
    if pending:
        raise DockerfileError(f"{source}:{start}: line continuation runs past the end of the file")
    return result


def split_stages(instructions: list[Instruction]) -> list[Stage]:
    """The stages in order; anything before the first FROM (ARG, ...) is not understood."""
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            stages.append(_from(ins))
        elif not stages:
            raise ins.error(f"{ins.keyword} before the first FROM is not supported")
        else:
            last = stages[-1]
            stages[-1] = Stage(last.start, last.base, last.name, (*last.body, ins))
    return stages


def _from(ins: Instruction) -> Stage:
    """FROM <image> [AS <name>], the image being the one this script has an equivalent of."""
    words = ins.value.split()
    if len(words) == 3 and words[1].upper() == "AS":
        base, name = words[0], words[2]
    elif len(words) == 1:
        base, name = words[0], None
    else:
        raise ins.error(f"FROM {ins.value!r}: expected FROM <image> [AS <name>]")
    if base != BASE_IMAGE:
        raise ins.error(f"base {base}: this script has an equivalent of {BASE_IMAGE} only")
    return Stage(ins, base, name)


def parse_dockerfile(text: str, source: str = "Dockerfile") -> ImageSpec:
    """The two stages the jaxps Dockerfiles have: a build stage that pip-installs '.[<extra>]'
    under a prefix, and a final stage that copies that prefix to /usr/local and sets the config."""
    stages = split_stages(read_instructions(text, source))
    if not stages:
        raise DockerfileError(f"{source}:1: no FROM")
    if len(stages) != 2:
        where = stages[2].start if len(stages) > 2 else stages[0].start
        raise where.error(f"{len(stages)} stages; expected a build stage and a final one")
    build, final = stages
    spec = ImageSpec()
    spec.extra, prefix = _build_stage(build)
    _FinalStage(spec, build=build, prefix=prefix).apply_all(final)
    return spec


def _build_stage(stage: Stage) -> tuple[str, str]:
    """The (extra, prefix) of the build stage's one `pip install --prefix=<dir> '.[<extra>]'`; its
    COPYs must bring only what this script hashes and stages for pip."""
    found: tuple[str, str] | None = None
    for ins in stage.body:
        if ins.keyword == "WORKDIR":
            continue  # build-stage only: the image never sees it
        if ins.keyword == "COPY":
            _check_copy_sources(ins)
        elif ins.keyword == "RUN" and found is None:
            found = _pip_install(ins)
        elif ins.keyword == "RUN":
            raise ins.error("a second RUN in the build stage is not supported")
        else:
            raise ins.error(f"{ins.keyword} in the build stage is not supported")
    if found is None:
        raise stage.start.error("the build stage has no RUN pip install '.[<extra>]'")
    return found


def _check_copy_sources(ins: Instruction) -> None:
    """COPY <src>... <dest> of the repo's package sources, no flags."""
    words = shlex.split(ins.value)
    if len(words) < 2 or any(word.startswith("--") for word in words):
        raise ins.error(f"COPY {ins.value!r}: expected COPY <src>... <dest>")
    allowed = {*SOURCE_FILES, *SOURCE_TREES}
    for src in words[:-1]:
        if posixpath.normpath(src) not in allowed:
            known = ", ".join(sorted(allowed))
            raise ins.error(f"COPY of {src}: the image recipe stages only {known}")


def _pip_install(ins: Instruction) -> tuple[str, str]:
    """(extra, prefix) from `pip install [options] --prefix=<dir> '.[<extra>]'`."""
    words = shlex.split(ins.value)
    if words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        words = ["pip", *words[3:]]
    if words[:2] != ["pip", "install"]:
        raise ins.error(f"RUN {ins.value!r}: only `pip install '.[<extra>]'` is supported")
    prefix, targets = "", []
    for word in words[2:]:
        if word.startswith("--prefix="):
            prefix = posixpath.normpath(word.partition("=")[2])
        elif word.startswith("-") and word not in PIP_OPTIONS:
            raise ins.error(f"pip option {word} is not supported")
        elif not word.startswith("-"):
            targets.append(word)
    match = re.fullmatch(r"\.\[([A-Za-z0-9_,-]+)\]", targets[0]) if len(targets) == 1 else None
    if match is None:
        raise ins.error(f"pip installs {targets}; expected exactly '.[<extra>]'")
    if not prefix:
        raise ins.error("pip install without --prefix=<dir> is not supported")
    return match[1], prefix


class _FinalStage:
    """Applies the final stage's instructions in order to an ImageSpec, with Docker's rules: ENV
    substitutes earlier values, WORKDIR is relative to the previous one, ENTRYPOINT clears a CMD
    not set in this stage."""

    def __init__(self, spec: ImageSpec, *, build: Stage, prefix: str) -> None:
        self.spec = spec
        self.build = build
        self.prefix = prefix
        self.cmd_set = False
        self.copied = False
        self.handlers: dict[str, Callable[[Instruction], None]] = {
            "COPY": self.copy,
            "ENV": self.env,
            "USER": self.user,
            "WORKDIR": self.workdir,
            "EXPOSE": self.expose,
            "ENTRYPOINT": self.entrypoint,
            "CMD": self.cmd,
        }

    def apply_all(self, stage: Stage) -> None:
        """Every instruction of the stage; the stage must copy the build stage's install."""
        for ins in stage.body:
            handler = self.handlers.get(ins.keyword)
            if handler is None:
                raise ins.error(f"{ins.keyword} in the final stage is not supported")
            handler(ins)
        if not self.copied:
            raise stage.start.error(f"the final stage never copies {self.prefix}")

    def copy(self, ins: Instruction) -> None:
        """Only COPY --from=<build> <prefix> /usr/local: the venv is this script's /usr/local."""
        words = shlex.split(ins.value)
        names = {f"--from={self.build.name}", "--from=0"} if self.build.name else {"--from=0"}
        expected = [self.prefix, PREFIX_TARGET]
        got = [posixpath.normpath(word) for word in words[1:]]
        if len(words) != 3 or words[0] not in names or got != expected:
            want = f"COPY --from={self.build.name or 0} {self.prefix} {PREFIX_TARGET}"
            raise ins.error(f"COPY {ins.value!r}: only {want!r} is supported")
        self.copied = True

    def env(self, ins: Instruction) -> None:
        """ENV k=v [k=v...] or the legacy ENV k v; every value sees the env before this line."""
        words = ins.value.split(None, 1)
        if "=" not in words[0]:
            pairs = [(words[0], words[1].strip() if len(words) > 1 else "")]
        else:
            pairs = [word.partition("=")[::2] for word in shlex.split(ins.value)]
        before = dict(self.spec.env)
        for key, value in pairs:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ins.error(f"ENV {ins.value!r}: {key!r} is not a variable name")
            self.spec.env[key] = _substitute(ins, value, before)

    def user(self, ins: Instruction) -> None:
        """A numeric uid[:gid]: the rootfs has no passwd entry for any name."""
        value = _substitute(ins, ins.value, self.spec.env)
        if not re.fullmatch(r"\d+(:\d+)?", value):
            raise ins.error(f"USER {value}: only a numeric uid[:gid] is supported")
        self.spec.user = value

    def workdir(self, ins: Instruction) -> None:
        """Absolute, or relative to the previous WORKDIR (/ at first)."""
        value = _substitute(ins, ins.value, self.spec.env)
        self.spec.workdir = posixpath.normpath(posixpath.join(self.spec.workdir or "/", value))

    def expose(self, ins: Instruction) -> None:
        """EXPOSE <port>[/tcp|/udp|/sctp]...; port ranges are not supported."""
        for word in _substitute(ins, ins.value, self.spec.env).split():
            port, _, proto = word.partition("/")
            proto = proto.lower() or "tcp"
            if not re.fullmatch(r"[1-9][0-9]{0,4}", port) or int(port) > 65535:
                raise ins.error(f"EXPOSE {word}: expected <port>[/tcp|/udp|/sctp]")
            if proto not in {"tcp", "udp", "sctp"}:
                raise ins.error(f"EXPOSE {word}: protocol {proto} is not tcp, udp or sctp")
            if f"{port}/{proto}" not in self.spec.ports:
                self.spec.ports.append(f"{port}/{proto}")

    def entrypoint(self, ins: Instruction) -> None:
        """Sets the entrypoint; clears the base image's CMD unless this stage set one."""
        self.spec.entrypoint = _command(ins)
        if not self.cmd_set:
            self.spec.cmd = None

    def cmd(self, ins: Instruction) -> None:
        """Sets the CMD."""
        self.spec.cmd = _command(ins)
        self.cmd_set = True


_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _substitute(ins: Instruction, value: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} as Docker expands them (unset: empty); ${VAR:-...} and the other forms are
    refused rather than passed on literally."""
    if "$" in _VARIABLE.sub("", value):
        raise ins.error(f"variable syntax in {value!r} is not supported")
    return _VARIABLE.sub(lambda m: env.get(m[1] or m[2], ""), value)


def _command(ins: Instruction) -> list[str]:
    """The exec form (a JSON list of strings) as is, the shell form under /bin/sh -c."""
    if not ins.value.startswith("["):
        return ["/bin/sh", "-c", ins.value]
    try:
        words = json.loads(ins.value)
    except json.JSONDecodeError as exc:
        raise ins.error(f"{ins.keyword} {ins.value!r}: not a JSON list ({exc})") from exc
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise ins.error(f"{ins.keyword} {ins.value!r}: not a JSON list of strings")
    return [str(word) for word in words]


def image_config(spec: ImageSpec, arch: str) -> dict[str, Any]:
    """The OCI image config (without rootfs, which the layer writer adds)."""
    config: dict[str, Any] = {"Env": [f"{key}={value}" for key, value in spec.env.items()]}
    if spec.user is not None:
        config["User"] = spec.user
    if spec.workdir is not None:
        config["WorkingDir"] = spec.workdir
    if spec.ports:
        config["ExposedPorts"] = {port: {} for port in spec.ports}
    if spec.entrypoint is not None:
        config["Entrypoint"] = spec.entrypoint
    if spec.cmd is not None:
        config["Cmd"] = spec.cmd
    return {"architecture": arch, "os": "linux", "config": config}


# ---------------------------------------------------------------------------------------------
# The OCI image layout


class _HashingSink:
    """The layer file as tarfile's stream writer sees it: each byte is hashed on its way to disk,
    so the ~1 GB layer is neither held in memory nor read back for its digest."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes, /) -> int:
        """Writes through and hashes."""
        self.raw.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def read(self, size: int, /) -> bytes:
        """Write-only."""
        raise io.UnsupportedOperation("write-only")

    def tell(self) -> int:
        """Bytes written so far."""
        return self.size

    def seek(self, pos: int, /) -> int:
        """A stream: no seeking."""
        raise io.UnsupportedOperation("not seekable")

    def close(self) -> None:
        """The caller owns (and closes) the file."""

    @property
    def digest(self) -> str:
        """sha256:<hex> of everything written."""
        return f"sha256:{self.sha.hexdigest()}"


def _walk(rootfs: Path) -> Iterator[Path]:
    """Every path under rootfs in a deterministic order, each directory before its contents,
    symlinks not followed, the contents of EMPTIED_DIRS left out."""

    def fail(exc: OSError) -> None:
        raise exc

    for dirpath, dirnames, filenames in os.walk(rootfs, onerror=fail):
        if Path(dirpath).relative_to(rootfs).as_posix() in EMPTIED_DIRS:
            dirnames.clear()
            continue
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            yield Path(dirpath, name)


def _add_path(tar: tarfile.TarFile, path: Path, *, arcname: str) -> None:
    """One entry with its mode, numeric uid/gid and whole-second mtime; tarfile itself turns a
    second name of an inode into a hardlink. Sockets are skipped (nothing a container needs)."""
    info = tar.gettarinfo(str(path), arcname)
    if info is None:
        _log(f"skipping {arcname} (a socket)")
        return
    info.uname = info.gname = ""
    info.mtime = int(info.mtime)
    if info.isreg():
        with path.open("rb") as data:
            tar.addfile(info, data)
    else:
        tar.addfile(info)


def write_layer(rootfs: Path, raw: BinaryIO) -> tuple[str, int]:
    """Streams the rootfs as one uncompressed layer tar into raw; returns (digest, size)."""
    sink = _HashingSink(raw)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(rootfs):
            _add_path(tar, path, arcname=path.relative_to(rootfs).as_posix())
    return sink.digest, sink.size


def _canonical(document: dict[str, Any]) -> bytes:
    """Stable JSON bytes, so equal documents have equal digests."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, blob: bytes) -> dict[str, Any]:
    """An OCI descriptor of an in-memory blob."""
    return {
        "mediaType": media_type,
        "digest": f"sha256:{hashlib.sha256(blob).hexdigest()}",
        "size": len(blob),
    }


def _add_bytes(tar: tarfile.TarFile, *, name: str, data: bytes) -> None:
    """A root-owned 0644 file with a fixed mtime, so equal content gives equal archive bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def _blob_name(digest: str) -> str:
    """blobs/sha256/<hex> for sha256:<hex>."""
    return "blobs/" + digest.replace(":", "/", 1)


def oci_documents(
    config: dict[str, Any], *, layer_digest: str, layer_size: int, ref: str
) -> dict[str, bytes]:
    """config, manifest and index.json for one layer: path in the layout -> bytes. The index names
    the image by its full ref twice, as org.opencontainers.image.ref.name (OCI) and as
    io.containerd.image.name (containerd's own): `ctr images import` of containerd 1.6.20 names
    the image from either, so an importer that reads only one of them still finds the ref."""
    config_blob = _canonical({**config, "rootfs": {"type": "layers", "diff_ids": [layer_digest]}})
    config_desc = _descriptor(CONFIG_TYPE, config_blob)
    layer_desc = {"mediaType": LAYER_TYPE, "digest": layer_digest, "size": layer_size}
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": config_desc,
        "layers": [layer_desc],
    }
    manifest_blob = _canonical(manifest)
    manifest_desc = {
        **_descriptor(MANIFEST_TYPE, manifest_blob),
        "platform": {"architecture": config["architecture"], "os": config["os"]},
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
    }
    index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": [manifest_desc]}
    return {
        _blob_name(config_desc["digest"]): config_blob,
        _blob_name(manifest_desc["digest"]): manifest_blob,
        "index.json": _canonical(index),
        "oci-layout": _canonical({"imageLayoutVersion": "1.0.0"}),
    }


def write_oci_archive(*, rootfs: Path, archive: Path, ref: str, config: dict[str, Any]) -> None:
    """The OCI image-layout tarball of rootfs at archive. The layer is streamed to a file beside
    the archive first (its digest names its blob), then copied in and removed."""
    layer = archive.with_name(archive.name + ".layer")
    try:
        with layer.open("wb") as raw:
            layer_digest, layer_size = write_layer(rootfs, raw)
        documents = oci_documents(config, layer_digest=layer_digest, layer_size=layer_size, ref=ref)
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            for directory in ("blobs", "blobs/sha256"):
                info = tarfile.TarInfo(directory)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            info = tarfile.TarInfo(_blob_name(layer_digest))
            info.size, info.mode = layer_size, 0o644
            with layer.open("rb") as data:
                tar.addfile(info, data)
            for name, blob in documents.items():
                _add_bytes(tar, name=name, data=blob)
    finally:
        layer.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Inputs, cache and build


@dataclass(frozen=True)
class Plan:
    """One image build: what goes in, the ref it gets and where its tarball lives."""

    name: str
    spec: ImageSpec
    root: Path
    inputs: tuple[str, ...]
    version: str
    hash12: str
    cache: Path

    @property
    def ref(self) -> str:
        """localhost/jaxps/<name>:<version>-<hash12>: never :latest (kubelet would pull that)."""
        return f"localhost/jaxps/{self.name}:{self.version}-{self.hash12}"

    @property
    def tar(self) -> Path:
        """The image tarball in the cache."""
        return self.cache / "images" / f"{self.name}-{self.hash12}.tar"


def cache_dir() -> Path:
    """${JAXPS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxps}: outside the repo, shared by builds."""
    if os.environ.get("JAXPS_CACHE"):
        return Path(os.environ["JAXPS_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "jaxps"


def shipped_sources(root: Path) -> list[str]:
    """pyproject.toml, README.md and what git would ship under runtime/ and operator/ (tracked
    plus untracked-not-ignored files, less deleted ones): what the package is built from."""
    flags = ["-z", "--cached", "--others", "--exclude-standard"]
    argv = ["git", "-C", str(root), "ls-files", *flags, "--", *SOURCE_TREES]
    done = subprocess.run(argv, capture_output=True, check=False)
    if done.returncode:
        message = done.stderr.decode().strip()
        raise SystemExit(f"image: {shlex.join(argv)} failed: {message}")
    out = done.stdout.decode()
    tree = sorted({name for name in out.split("\0") if name and (root / name).is_file()})
    return [*SOURCE_FILES, *tree]


def content_hash(root: Path, paths: list[str]) -> str:
    """sha256 over each path, its executable bit and its bytes, in the order given."""
    digest = hashlib.sha256()
    for rel in paths:
        path = root / rel
        data = path.read_bytes()
        executable = os.access(path, os.X_OK)
        digest.update(f"{rel}\0{int(executable)}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def make_plan(name: str, *, root: Path = ROOT, cache: Path | None = None) -> Plan:
    """Parses the image's Dockerfile and hashes every input of the image: the Dockerfile, the
    package sources and this script (its recipe)."""
    dockerfile = f"docker/{name}.Dockerfile"
    spec = parse_dockerfile((root / dockerfile).read_text(), dockerfile)
    script = Path(__file__).resolve().relative_to(root.resolve()).as_posix()
    inputs = (dockerfile, *shipped_sources(root), script)
    digest = content_hash(root, list(inputs))
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    return Plan(name, spec, root, inputs, str(version), digest[:12], cache or cache_dir())


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists (a scratch dir's owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    return True


def _mounts_under(path: Path) -> list[str]:
    """Mount points below path, deepest first (what an interrupted mmdebstrap can leave)."""
    prefix = str(path.resolve()) + "/"
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    # field 5 is the mount point, with space, tab, newline and backslash as octal escapes
    points = [line.split()[4].encode().decode("unicode_escape") for line in lines]
    return sorted((point for point in points if point.startswith(prefix)), reverse=True)


def remove_tree(path: Path) -> None:
    """rm -rf that first unmounts anything mounted below: rmtree must never walk into a mount."""
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], check=True)
    shutil.rmtree(path, ignore_errors=False)


def clear_stale_scratch(cache: Path) -> None:
    """Removes tmp/<pid>-* dirs whose build process is gone (killed builds)."""
    scratch = cache / "tmp"
    for entry in sorted(scratch.glob("*-*")) if scratch.is_dir() else []:
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _log(f"removing stale scratch {entry}")
            remove_tree(entry)


def prune(directory: Path, pattern: str, *, keep: int = KEEP) -> None:
    """Keeps the `keep` newest entries (by mtime; reuse touches) whose names match pattern."""
    entries = [entry for entry in directory.iterdir() if re.fullmatch(pattern, entry.name)]
    entries.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
    for entry in entries[keep:]:
        _log(f"pruning {entry}")
        if entry.is_dir():
            remove_tree(entry)
        else:
            entry.unlink()


def _run(argv: list[str], *, env: dict[str, str] | None = None) -> None:
    """Runs a step with its output on stderr. On an interrupt the child gets SIGTERM and time to
    clean up (mmdebstrap unmounts what it mounted) before this script gives up."""
    _log("$ " + shlex.join(argv))
    proc = subprocess.Popen(argv, stdout=sys.stderr, stdin=subprocess.DEVNULL, env=env)
    try:
        code = proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if code:
        raise SystemExit(f"image: {argv[0]} failed with exit status {code}")


def base_rootfs(cache: Path, scratch: Path) -> Path:
    """The Debian rootfs with python3 and the empty venv, built once per recipe (base/<key>)."""
    key = hashlib.sha256(
        _canonical({"argv": MMDEBSTRAP, "suite": DEBIAN_SUITE, "sources": DEBIAN_SOURCES})
    ).hexdigest()[:12]
    base = cache / "base" / f"{DEBIAN_SUITE}-{key}"
    if base.is_dir():
        _log(f"base rootfs {base} (cached)")
        os.utime(base)
        return base
    started = time.monotonic()
    target = scratch / "base"
    _run([*MMDEBSTRAP, DEBIAN_SUITE, str(target), *DEBIAN_SOURCES])
    base.parent.mkdir(parents=True, exist_ok=True)
    try:
        target.rename(base)
    except OSError:
        if not base.is_dir():
            raise
        _log(f"{base} appeared meanwhile (a concurrent build): using it")
        return base
    _log(f"base rootfs {base} built in {time.monotonic() - started:.1f} s")
    prune(base.parent, rf"{re.escape(DEBIAN_SUITE)}-[0-9a-f]{{12}}")
    return base


def stage_sources(plan: Plan, scratch: Path) -> Path:
    """A copy of the hashed inputs, hashed again: pip builds from it, so the image holds exactly
    what its hash says even when the working tree changes during the build."""
    src = scratch / "src"
    for rel in plan.inputs:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(plan.root / rel, src / rel)
    if content_hash(src, list(plan.inputs))[:12] != plan.hash12:
        raise SystemExit("image: the sources changed since they were hashed: run it again")
    return src


def build_wheels(plan: Plan, src: Path) -> Path:
    """Wheels of jaxps[<extra>] and its dependencies, built from src by the repo venv's pip on the
    host: its config reaches and trusts the package index, the chroot's would not."""
    python = plan.root / ".venv" / "bin" / "python"
    wheels = src.parent / "wheels"
    pip = [str(python), "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels)]
    _run([*pip, f"{src}[{plan.spec.extra}]"])
    return wheels


def install_package(*, rootfs: Path, wheels: Path, requirement: str) -> None:
    """pip install, inside the chroot, from the copied wheels only (no index, no host config)."""
    shutil.copytree(wheels, rootfs / "wheels")
    pip = [
        f"{VENV}/bin/pip",
        "install",
        "--no-index",
        "--no-cache-dir",
        "--root-user-action=ignore",
        "--quiet",
    ]
    _run(["chroot", str(rootfs), *pip, "--find-links", "/wheels", requirement], env=CHROOT_ENV)
    shutil.rmtree(rootfs / "wheels")


def host_arch() -> str:
    """The OCI architecture of this machine (mmdebstrap builds for it)."""
    machine = platform.machine()
    if machine not in ARCHES:
        raise SystemExit(f"image: no OCI architecture known for {machine}")
    return ARCHES[machine]


def check_host(root: Path) -> None:
    """What a build needs, said up front rather than half-way through."""
    if os.geteuid() != 0:
        raise SystemExit("image: building needs root (mmdebstrap --mode=root, chroot)")
    for tool in ("mmdebstrap", "chroot", "cp", "git"):
        if shutil.which(tool) is None:
            raise SystemExit(f"image: {tool} not found (hack/apt-install.sh mmdebstrap)")
    if not (root / ".venv" / "bin" / "python").exists():
        raise SystemExit(f"image: {root / '.venv'} is missing: run `make install` first")


def build_image(plan: Plan, scratch: Path) -> None:
    """base copy + jaxps[<extra>] + WORKDIR -> OCI tarball, renamed into place only when whole."""
    wheels = build_wheels(plan, stage_sources(plan, scratch))
    base = base_rootfs(plan.cache, scratch)
    rootfs = scratch / "rootfs"
    _log(f"copying {base} -> {rootfs}")
    _run(["cp", "-a", "--reflink=auto", str(base), str(rootfs)])
    install_package(
        rootfs=rootfs, wheels=wheels, requirement=f"jaxps[{plan.spec.extra}]=={plan.version}"
    )
    if plan.spec.workdir:
        (rootfs / plan.spec.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
    archive = scratch / plan.tar.name
    started = time.monotonic()
    config = image_config(plan.spec, host_arch())
    write_oci_archive(rootfs=rootfs, archive=archive, ref=plan.ref, config=config)
    _log(f"wrote {archive.stat().st_size / 1e6:.0f} MB in {time.monotonic() - started:.1f} s")
    plan.tar.parent.mkdir(parents=True, exist_ok=True)
    os.replace(archive, plan.tar)


def cached_build(tar: Path, name: str, cache: Path, make: Callable[[Path], None]) -> bool:
    """`tar` made by `make(scratch)` in a scratch directory of `cache` (removed afterwards),
    unless it is there already: then it is only touched and True is returned. Older tarballs
    of `name` are pruned either way."""
    tar_pattern = rf"{re.escape(name)}-[0-9a-f]{{12}}\.tar"
    if tar.is_file():
        os.utime(tar)
        prune(tar.parent, tar_pattern)
        return True
    clear_stale_scratch(cache)
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=cache / "tmp"))
    try:
        make(scratch)
    finally:
        remove_tree(scratch)
    prune(tar.parent, tar_pattern)
    return False


def build(plan: Plan) -> bool:
    """The image tarball at plan.tar; True when it was already there (then only touched)."""

    def make(scratch: Path) -> None:
        check_host(plan.root)
        os.umask(0o022)  # every file the image gets is readable by the Dockerfile's USER
        build_image(plan, scratch)

    return cached_build(plan.tar, plan.name, plan.cache, make)


# ---------------------------------------------------------------------------------------------
# An image of one static binary (no Dockerfile, no base)

# distroless/static's `nonroot` user, by number: the image has no passwd to look a name up in
NONROOT = "65532:65532"
STATIC_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class StaticPlan:
    """One static binary as a whole image, as a Dockerfile whose final stage is distroless/static
    would make it, less distroless' files (the binary needs none): one layer holding /<binary's
    name>, that path as the entrypoint, run from / as a numeric user. hash12 covers the binary's
    bytes, the ref, the user and this script, so a rebuilt binary is a new tarball under the same
    ref (the ref is what a chart names; containerd's import replaces the old image)."""

    binary: Path
    ref: str
    user: str
    hash12: str
    cache: Path

    @property
    def name(self) -> str:
        """The last part of the ref's repository: localhost/kueue:v0.17.0 -> kueue."""
        return self.ref.rsplit(":", 1)[0].rsplit("/", 1)[-1]

    @property
    def entrypoint(self) -> str:
        """Where the binary is in the image: /<its file name>."""
        return "/" + self.binary.name

    @property
    def tar(self) -> Path:
        """The image tarball in the cache, beside the Dockerfile images'."""
        return self.cache / "images" / f"{self.name}-{self.hash12}.tar"


def static_config(*, entrypoint: str, user: str, arch: str) -> dict[str, Any]:
    """The image config of a static binary: distroless/static's PATH, the user, WORKDIR / and
    the binary as ENTRYPOINT with no CMD."""
    spec = ImageSpec(
        env={"PATH": STATIC_PATH}, user=user, workdir="/", entrypoint=[entrypoint], cmd=None
    )
    return image_config(spec, arch)


def make_static_plan(
    binary: Path, *, ref: str, user: str = NONROOT, cache: Path | None = None
) -> StaticPlan:
    """Hashes the binary (streamed: it may be ~100 MB) with the ref, the user and this script."""
    if ":" not in ref.rsplit("/", 1)[-1] or ref.endswith(":latest"):
        raise SystemExit(f"image: {ref}: name a tag, not :latest (kubelet would pull that)")
    digest = hashlib.sha256(f"{ref}\0{user}\0".encode())
    digest.update(Path(__file__).read_bytes())
    with binary.open("rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return StaticPlan(binary, ref, user, digest.hexdigest()[:12], cache or cache_dir())


def build_static(plan: StaticPlan) -> bool:
    """The image tarball at plan.tar; True when it was already there (then only touched). Needs
    neither root nor a network: the binary is copied into a scratch rootfs, 0755, as the only
    file of the layer."""

    def make(scratch: Path) -> None:
        rootfs = scratch / "rootfs"
        rootfs.mkdir()
        target = rootfs / plan.entrypoint.lstrip("/")
        shutil.copy2(plan.binary, target)
        target.chmod(0o755)
        archive = scratch / plan.tar.name
        config = static_config(entrypoint=plan.entrypoint, user=plan.user, arch=host_arch())
        write_oci_archive(rootfs=rootfs, archive=archive, ref=plan.ref, config=config)
        plan.tar.parent.mkdir(parents=True, exist_ok=True)
        os.replace(archive, plan.tar)

    return cached_build(plan.tar, plan.name, plan.cache, make)


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, so scratch dirs are removed and children stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """The command line: build, ref or static."""
    parser = argparse.ArgumentParser(description=USAGE)
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="build the image tarball (or reuse it)")
    build_cmd.add_argument("name", choices=NAMES)
    build_cmd.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ref_cmd = commands.add_parser("ref", help="print the ref a build gives, without building")
    ref_cmd.add_argument("name", choices=NAMES)
    static_cmd = commands.add_parser("static", help="an image of one static binary (or reuse it)")
    static_cmd.add_argument("binary", type=Path)
    static_cmd.add_argument("--ref", required=True, help="e.g. localhost/kueue:v0.17.0")
    static_cmd.add_argument("--user", default=NONROOT, help=f"uid:gid (default {NONROOT})")
    static_cmd.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    if args.command == "static":
        static = make_static_plan(args.binary, ref=args.ref, user=args.user)
        name, ref, tar, cached = static.name, static.ref, static.tar, build_static(static)
    else:
        try:
            plan = make_plan(args.name)
        except DockerfileError as exc:
            print(f"image: {exc}", file=sys.stderr)
            return 2
        if args.command == "ref":
            print(plan.ref)
            return 0
        name, ref, tar, cached = plan.name, plan.ref, plan.tar, build(plan)
    result = {
        "name": name,
        "ref": ref,
        "tar": str(tar),
        "cached": cached,
        "seconds": round(time.monotonic() - started, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(f"{key}: {value}" for key, value in result.items()))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
