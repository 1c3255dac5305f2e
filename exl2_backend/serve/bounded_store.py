"""What the Responses API's stores share (serve/response_store.py, serve/conversation_store.py): entries by id in
the API process's memory, least recently used first out past a count or a byte bound (each entry's `size`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    size: int  # bytes the store's bound counts for this entry


E = TypeVar("E", bound=Sized)


class BoundedLRU(Generic[E]):
    def __init__(self, capacity: int, max_bytes: int):
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> E | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

    def _insert(self, key: str, entry: E) -> None:
        """Store `entry` as the most recently used, then evict past the bounds."""
        self.delete(key)
        self._entries[key] = entry
        self._grew(entry.size)

    def _grew(self, size: int) -> None:
        """An entry (the most recently used) grew by `size` bytes: evict the least recently used past the bounds,
        never the last one left."""
        self.bytes += size
        while len(self._entries) > self.capacity or (self.bytes > self.max_bytes and len(self._entries) > 1):
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
