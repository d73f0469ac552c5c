"""A ps's part of a checkpoint: one .npz file of its shards and their optimizer state.

Written atomically: into `<file>.tmp`, flushed and fsynced, then renamed over `<file>` (and the
directory fsynced), so a crash at any moment leaves the whole file or no file, never half of
one. Its SHA-256 goes into the chief's manifest; `read` verifies it before anything is loaded,
so a corrupted or truncated file is reported by name and never restored.

Layout: `value/<shard>` (the shard), `state/<shard>/<k>` (leaf k of its optax state, in
`jax.tree_util` order), `table/<i>/<key>` (the arrays of dynamic table part i, named in
meta's `tables`: [[shard, [key, ...]], ...]) and `meta` (JSON bytes: step, epoch, task,
optimizer, tables). No pickles.

Pure functions; each call touches only the file it is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

# Test failpoint: seconds to sleep between writing the temporary file and renaming it, so a
# test can kill a ps while its checkpoint is being written. Never set in production.
FAILPOINT_SAVE_SLEEP = "JAXPS_FAILPOINT_SAVE_SLEEP"


class ShardFileError(Exception):
    """The file is missing, corrupt, or not a shard file; the message names it."""


@dataclass(frozen=True)
class Contents:
    meta: dict[str, Any]
    values: dict[str, np.ndarray]
    states: dict[str, list[np.ndarray]]
    tables: dict[str, dict[str, np.ndarray]]  # dynamic tables' parts, by shard


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write(
    path: Path,
    *,
    meta: Mapping[str, Any],
    values: Mapping[str, Any],
    states: Mapping[str, Any],
    tables: Mapping[str, Mapping[str, np.ndarray]] | None = None,
) -> tuple[str, int]:
    """Writes the file atomically; returns its SHA-256 and size."""
    parts = sorted((tables or {}).items())
    index = [[name, sorted(arrays_of)] for name, arrays_of in parts]
    meta = {**meta, "tables": index} if index else dict(meta)
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(dict(meta), sort_keys=True).encode(), np.uint8)
    }
    for i, (_, arrays_of) in enumerate(parts):
        for key, array in sorted(arrays_of.items()):
            arrays[f"table/{i}/{key}"] = np.asarray(array)
    for name, value in values.items():
        arrays[f"value/{name}"] = np.asarray(value)
        for k, leaf in enumerate(jax.tree_util.tree_leaves(states[name])):
            arrays[f"state/{name}/{k}"] = np.asarray(leaf)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    with partial.open("wb") as out:
        np.savez(out, **arrays)  # type: ignore[arg-type]
        out.flush()
        os.fsync(out.fileno())
    delay = float(os.environ.get(FAILPOINT_SAVE_SLEEP, "0") or 0)
    if delay:
        time.sleep(delay)
    partial.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return sha256(path), path.stat().st_size


def read(path: Path, *, expected_sha256: str) -> Contents:
    """Verifies the checksum, then loads the file."""
    if not path.is_file():
        raise ShardFileError(f"checkpoint file {path} is missing")
    actual = sha256(path)
    if expected_sha256 and actual != expected_sha256:
        raise ShardFileError(
            f"checkpoint file {path} is corrupt: its sha256 is {actual[:16]}..., the manifest "
            f"says {expected_sha256[:16]}..."
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            values: dict[str, np.ndarray] = {}
            states: dict[str, list[tuple[int, np.ndarray]]] = {}
            for key in data.files:
                kind, _, rest = key.partition("/")
                if kind == "value":
                    values[rest] = data[key]
                elif kind == "state":
                    name, _, k = rest.rpartition("/")
                    states.setdefault(name, []).append((int(k), data[key]))
            tables = {
                str(name): {str(key): data[f"table/{i}/{key}"] for key in keys}
                for i, (name, keys) in enumerate(meta.get("tables", []))
            }
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
        raise ShardFileError(f"checkpoint file {path} cannot be read: {err}") from err
    return Contents(
        meta=meta,
        values=values,
        states={
            n: [leaf for _, leaf in sorted(leaves, key=lambda kv: kv[0])]
            for n, leaves in states.items()
        },
        tables=tables,
    )
