"""Processes as /proc shows them, for the tests that look inside a ps pod's keeper
(`jaxps_runtime.process.keeper`): its children and which of them is the ps."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> dict[int, int]:
    """The live children of process `pid`, each with its start time (clock ticks)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(entry.name)] = int(fields[19])  # starttime, field 22 of stat
    return out


def keepers_ps(keeper: int) -> int | None:
    """A keeper's ps process once its standby is there too (None until then): of its two
    children, the one it started first. A standby starts after the ps it stands by for and
    stays one until it takes over; its environment, as /proc shows it, still says
    JAXPS_STANDBY after that, so it cannot tell them apart."""
    kids = children(keeper)
    return min(kids, key=kids.__getitem__) if len(kids) == 2 else None
