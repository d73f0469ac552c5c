"""What a client and a ps agree on of a dynamic embedding table (`ps.dynamic`): which ps holds
an id's row (`owner`, `split`), a batch's ids once each (`dedup`), and the spec of one ps's
part of a table that an Init carries (`Spec`, TensorSpec.dynamic).

`owner` is a fixed 64-bit mixer (splitmix64's finalizer) of the id with a salt, modulo the ps
count: never `id % n`, which puts real ids' low bits (often equal: hashed to even numbers,
sequential) on one ps, nor Python's `hash` (`hash(-1) == hash(-2)`). Pure numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable
from typing import Literal

import numpy as np

Eviction = Literal["lru", "lfu"]

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_OWNER_SALT = np.uint64(0x6A09E667F3BCC909)
ADMIT_SALT = np.uint64(0x3C6EF372FE94F82B)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of each uint64 (wrapping arithmetic): a bijection whose every
    output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + GOLDEN  # a new array: the rest works in place
        z ^= z >> _S30
        z *= _M1
        z ^= z >> _S27
        z *= _M2
        z ^= z >> _S31
        return z


def bits(ids: np.ndarray) -> np.ndarray:
    """The int64 ids as their two's-complement uint64 bits (negative ids included)."""
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)


def owner(ids: np.ndarray, num_ps: int) -> np.ndarray:
    """The ps (0..num_ps-1) that holds each id's row."""
    return (mix64(bits(ids) ^ _OWNER_SALT) % np.uint64(num_ps)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One dynamic table as this ps holds it; `max_rows` is this ps's share of the job's."""

    name: str
    dim: int
    max_rows: int
    min_count: int = 1
    probability: float = 1.0
    eviction: Eviction = "lru"
    scale: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.dim < 1:
            problems.append(f"dim: {self.dim} is not at least 1")
        if self.max_rows < 1:
            problems.append(f"maxRows: {self.max_rows} per ps is not at least 1")
        if self.min_count < 1:
            problems.append(f"admission.minCount: {self.min_count} is not at least 1")
        if not 0 < self.probability <= 1:
            problems.append(f"admission.probability: {self.probability} is not in (0, 1]")
        if self.eviction not in ("lru", "lfu"):
            problems.append(f"eviction: {self.eviction!r} is not one of 'lru', 'lfu'")
        if problems:
            raise ValueError(f"embedding table {self.name!r}: " + "; ".join(problems))

    def to_json(self, *, ps: int, num_ps: int) -> str:
        """What an Init's TensorSpec.dynamic says of this table's part on ps `ps`."""
        fields = dataclasses.asdict(self)
        return json.dumps({**fields, "ps": ps, "num_ps": num_ps}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> tuple[Spec, int, int]:
        """(spec, ps, num_ps) of an Init's TensorSpec.dynamic (an edge: checked whole)."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not an object")
            ps, num_ps = raw.pop("ps"), raw.pop("num_ps")
            if not (isinstance(ps, int) and isinstance(num_ps, int) and 0 <= ps < num_ps):
                raise ValueError(f"ps {ps!r} of {num_ps!r}")
            types: dict[str, type | tuple[type, ...]] = {
                "name": str,
                "dim": int,
                "max_rows": int,
                "min_count": int,
                "probability": (int, float),
                "eviction": str,
                "scale": (int, float),
                "seed": int,
            }
            if set(raw) != set(types):
                raise ValueError(f"fields {sorted(raw)}; expected {sorted(types)}")
            for key, kind in types.items():
                if isinstance(raw[key], bool) or not isinstance(raw[key], kind):
                    raise TypeError(f"{key}: {raw[key]!r}")
            return cls(**raw), ps, num_ps
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{where}: not a dynamic table's spec ({err})") from None


def dedup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's ids as (unique ids, their occurrences, the position of each id in the unique
    ones): what a worker pulls, counts in its push, and remaps the batch with."""
    unique, inverse, counts = np.unique(
        np.asarray(ids, dtype=np.int64), return_inverse=True, return_counts=True
    )
    return unique, counts.astype(np.int64), inverse.reshape(np.shape(ids))


def split(ids: np.ndarray, num_ps: int) -> Iterable[tuple[int, np.ndarray]]:
    """The positions of `ids` each ps owns: (ps, positions), for the ps that own any."""
    owners = owner(ids, num_ps)
    for ps in range(num_ps):
        where = np.flatnonzero(owners == ps)
        if where.size:
            yield ps, where


@functools.lru_cache(maxsize=1024)
def table_salt(seed: int, table: str) -> np.uint64:
    """The salt of one table of one job: its seed and name, mixed (once: every read of a
    table's initial values asks for it)."""
    salt = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    for byte in table.encode():
        salt = mix64(np.array([salt ^ np.uint64(byte)], dtype=np.uint64))[0]
    return np.uint64(salt)


def initial_rows(ids: np.ndarray, *, dim: int, salt: np.uint64, scale: float) -> np.ndarray:
    """Each id's initial row: `dim` values uniform in [-scale, scale), a function of (salt,
    id, column) alone (float32, 24 random bits each: two columns from each 64-bit draw)."""
    base = mix64(bits(ids) ^ salt)
    pairs = (dim + 1) // 2
    with np.errstate(over="ignore"):
        columns = np.arange(1, pairs + 1, dtype=np.uint64) * GOLDEN
        drawn = mix64(base[:, None] + columns[None, :])
    halves = np.empty((ids.size, 2 * pairs), np.uint32)
    halves[:, 0::2] = drawn >> np.uint64(40)
    halves[:, 1::2] = (drawn >> np.uint64(8)) & np.uint64(0xFFFFFF)
    step = np.float32(2 * scale / (1 << 24))
    out = halves[:, :dim].astype(np.float32)
    out *= step
    out -= np.float32(scale)
    return out


def filled(spec: Spec, ids: np.ndarray, echoed: bytes, resident: np.ndarray) -> np.ndarray:
    """The rows of a dynamic table's `ids` as a Read gives them: those a ps sent (`resident`,
    of the ids it `echoed`: the asked ones it holds, in order; else ValueError) and every
    other one's initial value."""
    held = np.frombuffer(echoed, "<i8")
    here = np.isin(ids, held)
    if held.size != resident.shape[0] or not np.array_equal(ids[here], held):
        raise ValueError("the rows sent are not of the ids asked, in their order")
    salt = table_salt(spec.seed, spec.name)
    out = np.empty((ids.size, spec.dim), np.float32)
    out[here] = resident
    out[~here] = initial_rows(ids[~here], dim=spec.dim, salt=salt, scale=spec.scale)
    return out
