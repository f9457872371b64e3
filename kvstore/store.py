"""The scheduler's kvstore: the prefix-block index (block hash -> the workers holding it, by epoch).

It holds nothing about requests: a restarted scheduler rebuilds those from its gateways' and
workers' reports. Only the scheduler process uses the store, from one asyncio event loop, so every
read and write is a plain synchronous call on in-memory structures. ``MemoryKVStore`` is the
embedded backend and the base class of the Redis backend, which keeps this same index in memory and
writes it through in the background (see ``kvstore.redis_store``).

Block index entries are tagged with the holding worker's epoch: a restarted worker registers under
a new epoch, so the blocks its previous incarnation reported can never match a prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence


class MemoryKVStore:
    """Embedded backend: everything lives in this process's memory."""

    def __init__(self) -> None:
        # block hash -> {worker_id: epoch}
        self._index: dict[bytes, dict[str, int]] = {}
        # worker_id -> the hashes it has entries for (any epoch): purging a worker costs O(its blocks)
        self._by_worker: dict[str, set[bytes]] = {}

    # ---- prefix-block index -------------------------------------------------------------------

    def add_blocks(self, worker_id: str, epoch: int, hashes: Iterable[bytes]) -> None:
        """Record that ``worker_id`` (at ``epoch``) holds these blocks; replaces an older epoch's entry."""
        hashes = list(hashes)
        if not hashes:
            return
        index = self._index
        for h in hashes:
            holders = index.get(h)
            if holders is None:
                index[h] = {worker_id: epoch}
            else:
                holders[worker_id] = epoch
        self._by_worker.setdefault(worker_id, set()).update(hashes)

    def remove_blocks(self, worker_id: str, epoch: int, hashes: Iterable[bytes]) -> None:
        """Drop the worker's entries for these blocks, but only those recorded under ``epoch``.

        A late removal event from a previous incarnation must not delete what the new one reported.
        """
        owned = self._by_worker.get(worker_id)
        for h in hashes:
            holders = self._index.get(h)
            if holders is None or holders.get(worker_id) != epoch:
                continue
            del holders[worker_id]
            if not holders:
                del self._index[h]
            if owned is not None:
                owned.discard(h)
        if owned is not None and not owned:
            del self._by_worker[worker_id]

    def purge_worker(self, worker_id: str) -> int:
        """Drop every entry of a dead worker, whatever its epoch; returns how many were dropped."""
        owned = self._by_worker.pop(worker_id, set())
        for h in owned:
            holders = self._index[h]
            del holders[worker_id]
            if not holders:
                del self._index[h]
        return len(owned)

    def match_prefix(self, hashes: Sequence[bytes], epochs: dict[str, int]) -> dict[str, int]:
        """For each live worker (``epochs``: worker -> current epoch), how many leading ``hashes`` it
        holds under exactly that epoch, stopping at its first miss. Workers with 0 are omitted.

        Runs per request on up to a few hundred hashes: one index lookup per hash, and the workers
        still matching are checked without allocating until one of them drops out.
        """
        matched: dict[str, int] = {}
        first = self._index.get(hashes[0]) if hashes else None
        if first is None:
            return matched
        # Only workers holding the first block can match at all: usually a few of many live ones.
        live = [(w, e) for w, e in first.items() if epochs.get(w) == e]
        n = 1
        for h in itertools.islice(hashes, 1, None):
            if not live:
                return matched
            holders = self._index.get(h)
            if holders is None:
                break
            for w, e in live:
                if holders.get(w) != e:
                    break
            else:
                n += 1
                continue
            still = []
            for w, e in live:
                if holders.get(w) == e:
                    still.append((w, e))
                else:
                    matched[w] = n
            live = still
            n += 1
        for w, _ in live:
            matched[w] = n
        return matched

    def num_blocks(self, worker_id: str) -> int:
        """How many blocks the index records for the worker (any epoch)."""
        return len(self._by_worker.get(worker_id, ()))

    # ---- lifecycle: nothing to do in memory ---------------------------------------------------

    async def start(self) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @property
    def healthy(self) -> bool:
        return True
