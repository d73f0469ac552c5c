"""The pushes a ps remembers by id: which shards each has updated, and whether it has counted
a step. A retried push (same id: the worker's call broke and it sent it again) skips the shards
it updated already and counts no second step.

Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED = 4096  # the most recent push ids kept; older ones are forgotten


class PushLog:
    """The last `REMEMBERED` push ids: the shards each updated, and those that counted."""

    def __init__(self) -> None:
        self._updated: OrderedDict[str, set[str]] = OrderedDict()
        self._counted: set[str] = set()

    def updated(self, push_id: str) -> set[str]:
        """The shards a push with this id has updated (a copy; none for no id)."""
        return set(self._updated.get(push_id, ())) if push_id else set()

    def note_update(self, push_id: str, name: str) -> None:
        if push_id:
            self._updated.setdefault(push_id, set()).add(name)

    def counted(self, push_id: str) -> bool:
        """Whether a push with this id has counted a step (no id: never)."""
        return bool(push_id) and push_id in self._counted

    def note_counted(self, push_id: str) -> None:
        """Remembers that this push counted, forgetting the oldest ids past `REMEMBERED`."""
        if not push_id:
            return
        self._updated.setdefault(push_id, set())
        self._updated.move_to_end(push_id)
        self._counted.add(push_id)
        while len(self._updated) > REMEMBERED:
            forgotten, _ = self._updated.popitem(last=False)
            self._counted.discard(forgotten)

    def clear(self) -> None:
        self._updated.clear()
        self._counted.clear()
