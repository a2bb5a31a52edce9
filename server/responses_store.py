"""The Responses API's store: finished responses by id, for ``previous_response_id`` and GET/DELETE.

Bounded: at most ``capacity`` responses, the least recently stored or read dropped first (a client continuing a
conversation reads its last response, which keeps it). Each entry holds the response object as served and the
conversation that led to it, as chat messages (instructions excluded: OpenAI does not carry them over), so a
follow-up renders the same prompt prefix and hits the radix cache. The store lives in the front end's memory:
a restart forgets it, as a fresh ``store`` would.

A streamed background response also keeps its events, to be streamed again; they are bounded in size
(``MAX_EVENT_CHARS`` of JSON, ~200 a token): past it, the least recently used responses lose their events first
(they stay retrievable, only not as a stream).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

MAX_EVENT_CHARS = 256 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # chat messages, the response's own output last
    events: tuple[str, ...] | None = None  # a streamed background response's events, for streaming it again


class ResponseStore:
    def __init__(self, capacity: int, max_event_chars: int = MAX_EVENT_CHARS) -> None:
        self.capacity = capacity
        self.max_event_chars = max_event_chars
        self.event_chars = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._drop(entry.response["id"])
            self._items[entry.response["id"]] = entry
            self.event_chars += _size(entry)
            while len(self._items) > self.capacity:
                self._drop(next(iter(self._items)))
            for key in list(self._items):  # oldest first; the entry just put last
                if self.event_chars <= self.max_event_chars:
                    break
                old = self._items[key]
                if old.events is not None:
                    self.event_chars -= _size(old)
                    self._items[key] = replace(old, events=None)

    def _drop(self, response_id: str) -> None:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.event_chars -= _size(old)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            found = response_id in self._items
            self._drop(response_id)
            return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _size(entry: StoredResponse) -> int:
    return sum(len(e) for e in entry.events) if entry.events is not None else 0
