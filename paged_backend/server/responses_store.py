"""Stored responses: bounded in count and age, and isolated per API key.

An entry belongs to the hash of the credential its request presented (`Authorization: Bearer` or `x-api-key`),
and is found only under that owner, so one key can never read, continue, cancel or delete another's response.
With no API key configured every request shares one space. The oldest entries go first when the store is full,
and any entry older than the TTL is gone.

>>> store = ResponseStore(max_entries=1, ttl=60)
>>> store.put("alice", "resp_1", "first"); store.put("alice", "resp_2", "second")
>>> store.get("alice", "resp_1"), store.get("bob", "resp_2"), store.get("alice", "resp_2")
(None, None, 'second')
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
SHARED_SPACE = ""


def credential_owner(headers: Mapping[str, str], api_key_configured: bool) -> str:
    """Whose store space a request reads: a hash of the key it presented (never the key itself)."""
    if not api_key_configured:
        return SHARED_SPACE
    authorization = headers.get("authorization", "")
    credential = (
        authorization[len("Bearer ") :] if authorization.startswith("Bearer ") else headers.get("x-api-key", "")
    )
    return hashlib.sha256(credential.encode()).hexdigest()


class ResponseStore(Generic[T]):
    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, T]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, owner: str, response_id: str, value: T) -> None:
        self._expire()
        self._entries[(owner, response_id)] = (self.clock(), value)
        self._entries.move_to_end((owner, response_id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> T | None:
        self._expire()
        entry = self._entries.get((owner, response_id))
        return None if entry is None else entry[1]

    def delete(self, owner: str, response_id: str) -> bool:
        self._expire()
        return self._entries.pop((owner, response_id), None) is not None

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        while self._entries and next(iter(self._entries.values()))[0] <= deadline:
            self._entries.popitem(last=False)
