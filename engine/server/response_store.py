"""Stored responses of /v1/responses: `store: true` keeps a response so a later request can continue it
(`previous_response_id`) and a client can read it back (GET) or delete it.

In memory, per server process: at most `max_entries` responses (the oldest go first) for at most `ttl_s`
seconds each. A restart, an eviction or the TTL forgets a response; asking for it then is a 404 that says so.
Only the event loop touches the store, so it needs no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from stallfree.engine.server.errors import NotFound


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as GET returns it
    conversation: list[dict[str, Any]]  # its input and output as chat messages (without instructions)
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock=time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"the response store's size must be >= 0, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"the response store's TTL must be > 0 seconds, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a finished response; the oldest go when the store is full (size 0: nothing is kept)."""
        if self.max_entries == 0:
            return
        self._entries[body["id"]] = StoredResponse(body, conversation, self._clock())
        self._entries.move_to_end(body["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or NotFound naming `param` (the request field that gave the id)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise NotFound(self._missing(response_id), param=param, code="response_not_found")
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def _missing(self, response_id: str) -> str:
        if self.max_entries == 0:
            return f"no response {response_id!r}: this server stores no responses (--responses-store-size 0)"
        return (
            f"no response {response_id!r}: it was never stored here (store: false, or another server), or "
            f"it expired (responses are kept in memory for {self.ttl_s:g} s, at most {self.max_entries})"
        )

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > cutoff:
                break
            self._entries.popitem(last=False)
