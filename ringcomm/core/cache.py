"""Response cache: steady-state training re-sends small ids instead of full requests.  Pure.

Every rank keeps an identical cache because every rank records the same
requests in the same order: the names of each executed response, in the
order rank 0 fixed.  A rank whose next request equals a cached one sends the
integer id; rank 0 expands it with its own copy.  Rank 0 always records a
response before it can receive a request that uses the new id, so ids it
receives are always known to it.
"""

from __future__ import annotations

from .wire import Request


class ResponseCache:
    """Bounded, append-only map between requests and small integer ids."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_id: list[Request] = []
        self._by_req: dict[Request, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def lookup(self, req: Request) -> int | None:
        """The id of an identical cached request, or None."""
        return self._by_req.get(req)

    def get(self, cache_id: int) -> Request:
        """The request for an id; raises KeyError for an unknown id."""
        if not 0 <= cache_id < len(self._by_id):
            raise KeyError(cache_id)
        return self._by_id[cache_id]

    def record(self, req: Request) -> None:
        """Add ``req`` if it is new and there is room (same call order on every rank)."""
        if req in self._by_req or len(self._by_id) >= self.capacity:
            return
        self._by_req[req] = len(self._by_id)
        self._by_id.append(req)
