"""Datasets read from the user's files: named arrays (`.npz`, a directory of `.npy`), Parquet
(pyarrow) and MNIST's IDX files. Paths come from the manifest: a volume every pod mounts,
locally any directory.

All are `arrays.ArrayDataset`s, so they shard, shuffle and resume exactly as the built-ins do:
worker `w` of `n` reads rows `w::n` of the training set in an order drawn from (seed, worker,
epoch), and the batch of a worker's local step `s` is a pure function of (seed, w, n, s). Each
push carries the worker's data cursor (the batches it has used); the ps records it with the
update and in its part of every checkpoint, so a restarted worker reads on right after the
last batch whose gradient reached the ps, and a restored job from the checkpoint's position:
neither repeating nor skipping a batch that counted. (This is
what Grain's index samplers give; with the sampler already a pure function of the step, Grain
would add a dependency and a second notion of position for no new property.)

Nothing larger than a batch is read into memory: `.npy` files and the stored (uncompressed)
members of an `.npz` are memory-mapped, as are IDX files; a batch reads only its rows. A
compressed `.npz` member or a gzipped IDX file is decompressed into memory (said in the log).
Parquet columns are decoded once into memory (Parquet pages are compressed): a Parquet dataset
must fit in memory; convert a larger one to `.npy` files.

Every problem is a `ModelError` naming the field (`dataset.kwargs.path`), the path and what
was expected, raised when the task starts, before training: a permanent failure.
"""

from __future__ import annotations

import gzip
import logging
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxps_runtime.config.catalog import ModelError
from jaxps_runtime.data.arrays import ArrayDataset, Batch

log = logging.getLogger(__name__)

IDX_TYPES: dict[int, Any] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
MNIST_FILES = {
    ("train", "x"): "train-images-idx3-ubyte",
    ("train", "y"): "train-labels-idx1-ubyte",
    ("test", "x"): "t10k-images-idx3-ubyte",
    ("test", "y"): "t10k-labels-idx1-ubyte",
}


# --- IDX --------------------------------------------------------------------------------------


def read_idx(path: Path, *, where: str) -> np.ndarray:
    """One IDX file (LeCun's format: magic 0 0 type ndim, big-endian dims, data), memory-mapped;
    a `.gz` one decompressed into memory."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
            log.info("%s: gzipped, read into memory (%d bytes)", path, len(raw))
            header, data = _idx_header(raw[: 4 + 4 * 255], path=path, where=where), raw
            dtype, shape, offset = header
            array = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)), offset=offset)
            return array.reshape(shape)
        with path.open("rb") as f:
            head = f.read(4 + 4 * 255)
        dtype, shape, offset = _idx_header(head, path=path, where=where)
        size = path.stat().st_size
    except OSError as err:
        raise ModelError(f"{where}: {path}: cannot read it ({err.strerror or err})") from None
    except (EOFError, gzip.BadGzipFile) as err:
        raise ModelError(f"{where}: {path}: not a gzipped IDX file ({err})") from None
    need = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < need:
        raise ModelError(
            f"{where}: {path}: {size} bytes, but its header announces {list(shape)} "
            f"{np.dtype(dtype).name} values ({need} bytes): the file is cut short"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def _idx_header(
    head: bytes, *, path: Path, where: str
) -> tuple[np.dtype[np.generic], tuple[int, ...], int]:
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in IDX_TYPES:
        raise ModelError(
            f"{where}: {path}: not an IDX file (its first bytes are {head[:4].hex()}; IDX files "
            "start 00 00, a type byte and the number of dimensions)"
        )
    ndim = head[3]
    if ndim == 0 or len(head) < 4 + 4 * ndim:
        raise ModelError(f"{where}: {path}: an IDX header of {ndim} dimensions is cut short")
    shape = tuple(int.from_bytes(head[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.dtype(IDX_TYPES[head[2]]), shape, 4 + 4 * ndim


def has_idx_files(directory: str) -> bool:
    """Whether `directory` holds any of MNIST's four files (then all four must be there)."""
    root = Path(directory)
    return any((root / n).is_file() or (root / f"{n}.gz").is_file() for n in MNIST_FILES.values())


def idx_arrays(directory: str, *, where: str) -> dict[str, dict[str, np.ndarray]]:
    """MNIST's four files (or Fashion-MNIST's, same names), each maybe `.gz`, in `directory`:
    {"train": {"x": [n, rows*cols] as stored (uint8), "y": [n]}, "test": {...}}."""
    root = Path(directory)
    if not root.is_dir():
        raise ModelError(
            f"{where}: {directory!r} is not a directory; expected one holding "
            f"{', '.join(MNIST_FILES.values())} (each may end .gz)"
        )
    out: dict[str, dict[str, np.ndarray]] = {"train": {}, "test": {}}
    for (split, key), name in MNIST_FILES.items():
        found = next((p for p in (root / name, root / f"{name}.gz") if p.is_file()), None)
        if found is None:
            raise ModelError(
                f"{where}: {directory}: no {name} (nor {name}.gz); an MNIST directory holds "
                f"{', '.join(MNIST_FILES.values())}"
            )
        out[split][key] = read_idx(found, where=where)
    for split, arrays in out.items():
        images, labels = arrays["x"], arrays["y"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ModelError(
                f"{where}: {directory}: the {split} images are {list(images.shape)} and the "
                f"labels {list(labels.shape)}; expected [n, rows, cols] images and [n] labels"
            )
        arrays["x"] = images.reshape(len(images), -1)  # a view: still memory-mapped
        arrays["y"] = labels
    return out


# --- named arrays -----------------------------------------------------------------------------


def array_files(path: str, *, where: str) -> dict[str, np.ndarray]:
    """The named arrays of an `.npz` file or of a directory of `.npy` files (name: the file's
    stem), memory-mapped where they are stored uncompressed."""
    source = Path(path)
    if source.is_dir():
        files = sorted(source.glob("*.npy"))
        if not files:
            raise ModelError(f"{where}: {path}: a directory with no .npy file in it")
        out = {}
        for file in files:
            try:
                out[file.stem] = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as err:
                raise ModelError(f"{where}: {file}: not a .npy array ({err})") from None
        return out
    if source.suffix != ".npz" or not source.is_file():
        state = "no such file" if not source.exists() else "not an .npz file"
        raise ModelError(
            f"{where}: {path}: {state}; expected an .npz file or a directory of .npy files"
        )
    return _npz(source, where=where)


def _npz(path: Path, *, where: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as archive, path.open("rb") as raw:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename.removesuffix(".npy")
                if info.compress_type != zipfile.ZIP_STORED:
                    with archive.open(info) as member:
                        out[name] = np.lib.format.read_array(member, allow_pickle=False)
                    log.info("%s: %s is compressed, read into memory", path, name)
                    continue
                raw.seek(info.header_offset + 26)  # the local header's name and extra lengths
                lengths = np.frombuffer(raw.read(4), "<u2")
                start = info.header_offset + 30 + int(lengths[0]) + int(lengths[1])
                raw.seek(start)
                version = np.lib.format.read_magic(raw)
                header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = header(raw)
                if dtype.hasobject:
                    raise ModelError(f"{where}: {path}: {name} holds Python objects; not data")
                out[name] = np.memmap(
                    path,
                    dtype=dtype,
                    mode="r",
                    offset=raw.tell(),
                    shape=shape,
                    order="F" if fortran else "C",
                )
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise ModelError(f"{where}: {path}: not a readable .npz file ({err})") from None
    if not out:
        raise ModelError(f"{where}: {path}: an .npz file with no array in it")
    return out


def select(
    arrays: Mapping[str, np.ndarray], keys: Mapping[str, str] | None, *, path: str, where: str
) -> dict[str, np.ndarray]:
    """The batch keys: `keys` maps each to an array name (none: every array, by its name); all
    with the same number of rows."""
    chosen = dict(keys) if keys else {name: name for name in arrays}
    missing = sorted(v for v in chosen.values() if v not in arrays)
    if missing:
        raise ModelError(
            f"{where.rsplit('.', 1)[0]}.keys: {path} has no array {', '.join(map(repr, missing))}; "
            f"it has {', '.join(sorted(arrays))}"
        )
    out = {key: arrays[name] for key, name in chosen.items()}
    scalars = sorted(chosen[key] for key, array in out.items() if np.ndim(array) == 0)
    if scalars:  # len() of a 0-d array raised TypeError, blamed on the user's code
        raise ModelError(
            f"{where}: {path}: array {', '.join(map(repr, scalars))} is a single value (0-d); "
            "every array is one value per example (its first axis the examples)"
        )
    lengths = {key: len(array) for key, array in out.items()}
    if len(set(lengths.values())) > 1:
        raise ModelError(
            f"{where}: {path}: the arrays differ in rows ({lengths}); every array is one "
            "value per example"
        )
    return out


def split_tail(
    arrays: Mapping[str, np.ndarray], fraction: float, *, path: str, where: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The last `fraction` of the rows as the test set (a view: nothing is copied). Files
    are expected in no particular order of label; give `test` for a split of your own."""
    rows = len(next(iter(arrays.values())))
    cut = rows - round(fraction * rows)
    if cut < 1 or cut >= rows:
        raise ModelError(
            f"{where}: {path}: {rows} examples; testFraction {fraction} leaves an empty "
            "train or test set"
        )
    return (
        {key: array[:cut] for key, array in arrays.items()},
        {key: array[cut:] for key, array in arrays.items()},
    )


# --- the datasets ---------------------------------------------------------------------------


def idx_dataset(*, directory: str, seed: int, where: str = "dataset.kwargs.dir") -> ArrayDataset:
    """MNIST from its IDX files: `x` float32 [B, rows*cols] in [0, 1], `y` int32 [B]."""
    arrays = idx_arrays(directory, where=where)
    return _Pixels(train=arrays["train"], test=arrays["test"], seed=seed)


class _Pixels(ArrayDataset):
    """Bytes on disk, floats in a batch: each batch's images are scaled as they are read, so the
    memory-mapped file is never converted whole."""

    def train_batch(self, *, worker: int, num_workers: int, step: int, batch_size: int) -> Batch:
        return _scaled(
            super().train_batch(
                worker=worker, num_workers=num_workers, step=step, batch_size=batch_size
            )
        )

    def examples(self, rows: np.ndarray) -> Batch:
        return _scaled(super().examples(rows))

    def test(self) -> Batch:
        return _scaled(super().test())


def _scaled(batch: Batch) -> Batch:
    return {
        "x": np.asarray(batch["x"], np.float32) / np.float32(255.0),
        "y": np.asarray(batch["y"], np.int32),
    }


# --- Parquet ----------------------------------------------------------------------------------


def parquet_arrays(
    path: str, columns: Mapping[str, str] | None, *, where: str
) -> dict[str, np.ndarray]:
    """Columns of a Parquet file (or a directory of them) as arrays under their batch keys
    (`columns`: {batch key: column}; none: every column under its name). Numeric columns give
    [n] arrays, fixed-size lists of numbers [n, width]; nulls are refused."""
    import pyarrow as pa  # noqa: PLC0415 (only a job on Parquet needs it)
    import pyarrow.parquet as pq  # noqa: PLC0415

    source = Path(path)
    if not source.exists():
        raise ModelError(f"{where}: {path}: no such file or directory; expected a Parquet file")
    try:
        schema = pq.read_schema(source) if source.is_file() else pq.ParquetDataset(source).schema
    except (OSError, pa.ArrowException) as err:
        raise ModelError(f"{where}: {path}: not readable as Parquet ({err})") from None
    chosen = dict(columns) if columns else {name: name for name in schema.names}
    missing = sorted(c for c in chosen.values() if c not in schema.names)
    if missing:
        raise ModelError(
            f"{where.rsplit('.', 1)[0]}.columns: {path} has no column "
            f"{', '.join(map(repr, missing))}; it has {', '.join(schema.names)}"
        )
    try:
        table = pq.read_table(source, columns=sorted(set(chosen.values())), memory_map=True)
    except (OSError, pa.ArrowException) as err:
        raise ModelError(f"{where}: {path}: not readable as Parquet ({err})") from None
    out = {}
    for key, name in chosen.items():
        column = table.column(name)
        if column.null_count:
            raise ModelError(
                f"{where}: {path}: column {name!r} has {column.null_count} null values; "
                "every example needs a value"
            )
        kind = column.type
        if pa.types.is_fixed_size_list(kind) and _numeric(kind.value_type):
            flat = column.combine_chunks().flatten().to_numpy()
            out[key] = flat.reshape(len(column), kind.list_size)
        elif _numeric(kind):
            out[key] = column.to_numpy()
        else:
            raise ModelError(
                f"{where}: {path}: column {name!r} is {kind}; expected numbers or fixed-size "
                "lists of numbers"
            )
    return out


def _numeric(kind: Any) -> bool:
    import pyarrow as pa  # noqa: PLC0415

    return bool(
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    )


def _same_rows(arrays: Mapping[str, np.ndarray], *, path: str, where: str) -> None:
    if (
        not arrays
        or len({len(a) for a in arrays.values()}) != 1
        or not len(next(iter(arrays.values())))
    ):
        raise ModelError(f"{where}: {path}: no rows, or columns of different lengths")


# --- the datasets of named arrays -------------------------------------------------------------


def build(name: str, opts: Mapping[str, Any], *, seed: int) -> ArrayDataset:
    """The file dataset `name` (`idx`, `arrays`, `parquet`) from its checked keyword arguments."""
    if name == "idx":
        return idx_dataset(directory=opts["dir"], seed=seed)
    if name == "parquet":

        def read(source: str, where: str) -> dict[str, np.ndarray]:
            arrays = parquet_arrays(source, opts["columns"], where=where)
            _same_rows(arrays, path=source, where=where)
            return arrays

    else:

        def read(source: str, where: str) -> dict[str, np.ndarray]:
            return select(array_files(source, where=where), opts["keys"], path=source, where=where)

    return _split(
        read, path=opts["path"], test=opts["test"], fraction=opts["testFraction"], seed=seed
    )


def _split(
    read: Callable[[str, str], dict[str, np.ndarray]],
    *,
    path: str,
    test: str | None,
    fraction: float,
    seed: int,
    where: str = "dataset.kwargs",
) -> ArrayDataset:
    """The training set from `path`; the test set from `test`, else the tail of `path`'s rows."""
    train = read(path, f"{where}.path")
    if test is not None:
        held = read(test, f"{where}.test")
        _same_layout(train, held, path=path, test=test, where=f"{where}.test")
    else:
        train, held = split_tail(train, fraction, path=path, where=f"{where}.testFraction")
    return ArrayDataset(train=train, test=held, seed=seed)


def _same_layout(
    train: Mapping[str, np.ndarray],
    held: Mapping[str, np.ndarray],
    *,
    path: str,
    test: str,
    where: str,
) -> None:
    """The test file's arrays are the training file's: the same keys, and per example the same
    shape and kind (a model sized from one was blamed on `model.kwargs` for the other)."""
    if set(train) != set(held):
        raise ModelError(
            f"{where}: {test} has arrays {', '.join(sorted(held))}; {path} has "
            f"{', '.join(sorted(train))}: the test set needs the same"
        )
    for key in sorted(train):
        ours, theirs = train[key], held[key]
        if ours.shape[1:] != theirs.shape[1:] or ours.dtype.kind != theirs.dtype.kind:
            raise ModelError(
                f"{where}: {test}'s {key!r} is {theirs.dtype}{list(theirs.shape[1:])} per "
                f"example; {path}'s is {ours.dtype}{list(ours.shape[1:])}: the test set needs "
                "the same"
            )
