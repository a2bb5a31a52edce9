"""The Responses API's store: finished responses by id, for ``previous_response_id`` and GET/DELETE.

Bounded: at most ``capacity`` responses, the least recently stored or read dropped first (a client continuing a
conversation reads its last response, which keeps it). Each entry holds the response object as served and the
conversation that led to it, as chat messages (instructions excluded: OpenAI does not carry them over), so a
follow-up renders the same prompt prefix and hits the radix cache. The store lives in the front end's memory:
a restart forgets it, as a fresh ``store`` would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # chat messages, the response's own output last
    events: tuple[str, ...] | None = None  # a streamed background response's events, for streaming it again


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[entry.response["id"]] = entry
            self._items.move_to_end(entry.response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
