"""Stored responses: bounded in count and age, and isolated per API key; a background response's events, kept
for GET ?stream=true (`EventLog`).

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

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
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


class EventLog:
    """A background response's stream events as sent (encoded at once, so later changes to the response do not
    rewrite them), event i being sequence number i. Any number of readers replay it from a sequence number and
    follow the run live until it ends.

    >>> async def demo():
    ...     log = EventLog()
    ...     log.append(b"0"); log.append(b"1")
    ...     reader = log.follow(starting_after=0)
    ...     first = await anext(reader)
    ...     log.append(b"2"); log.close()
    ...     return [first] + [event async for event in reader]
    >>> asyncio.run(demo())
    [b'1', b'2']
    """

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: bytes) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        """The run ended (finished, failed or cancelled): readers stop once they have read everything."""
        self.closed = True
        self._wake()

    async def follow(self, starting_after: int | None = None) -> AsyncIterator[bytes]:
        """The events after sequence number `starting_after` (all of them when None), then each new one."""
        index = 0 if starting_after is None else starting_after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.closed:
                return
            changed = self._changed  # taken before waiting: a wake between the check and the wait is not lost
            await changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # waiters hold the one just set; the next wait gets a fresh one
