"""Redis backend of the kvstore: the in-memory block index, written through to Redis in the background.

Every read is served from the in-memory mirror (the base class), so serving never waits on Redis.
Each write method updates memory and queues the matching Redis commands; a flusher task sends
the queue every ``flush_interval_s`` as ONE non-transactional pipeline, so the cost is one round
trip per interval, never one per call or per block. Redis is there so the block index outlives a
scheduler restart (``start()`` loads it back) and can live off the scheduler's host.

Key layout (``{p}`` is ``key_prefix``, ``{hex}`` a block hash in lowercase hex):

- ``{p}blk:{hex}``            HASH  worker_id -> epoch                     (the prefix-block index)
- ``{p}wblk:{worker_id}``     SET   hex hashes the worker has entries for  (the reverse index)
- ``{p}sentinel``             STRING  present while Redis holds our full state

The store owns every key under ``{p}`` (a resync deletes the ones memory does not have), so two
stores must not use prefixes where one starts with the other.

Failures: Redis may restart mid-run and keeps nothing on disk. A failed flush never reaches the
callers; it logs one warning per outage, marks the store unhealthy, drops the queued commands and
schedules a full resync, retried with backoff (at most ``MAX_BACKOFF_S``). A restart the client
reconnected across without an error is caught by the sentinel: every flush pipeline starts with
``EXISTS {p}sentinel``, and an idle store probes it every ``PROBE_INTERVAL_S``. A full resync deletes
our keys that memory no longer has, rewrites every key from memory in pipelined chunks and sets
the sentinel last; then the store is healthy again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from metroserve.kvstore.store import MemoryKVStore

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 0.5
PROBE_INTERVAL_S = 1.0
# Commands per pipeline when loading or resyncing the whole state.
CHUNK = 2000
# Fail fast when Redis is down so the flusher never hangs on it.
SOCKET_TIMEOUT_S = 1.0

_REDIS_ERRORS = (RedisError, OSError)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisKVStore(MemoryKVStore):
    """The memory store plus a background write-through to Redis; call ``start()`` before use."""

    def __init__(self, url: str, key_prefix: str = "metroserve:", flush_interval_s: float = 0.02) -> None:
        super().__init__()
        self._url = url
        self._prefix = key_prefix
        self._flush_interval_s = flush_interval_s
        # No client-side retries: a failure must surface at once, so the store turns unhealthy and
        # schedules a resync; that full, idempotent rewrite covers every failure.
        self._redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._ops: list[list] = []
        # Until start() has loaded and rewritten the state, there is nothing to write through.
        self._needs_resync = True
        self._healthy = False
        self._lock = asyncio.Lock()
        self._started = False
        self._flusher: asyncio.Task | None = None

    # ---- keys ---------------------------------------------------------------------------------

    def _blk_key(self, h: bytes) -> str:
        return f"{self._prefix}blk:{h.hex()}"

    def _wblk_key(self, worker_id: str) -> str:
        return f"{self._prefix}wblk:{worker_id}"

    @property
    def _sentinel_key(self) -> str:
        return f"{self._prefix}sentinel"

    # ---- write path ---------------------------------------------------------------------------

    def _queue(self, op: list) -> None:
        """Queue one command for the flusher; during an outage the coming resync covers it instead."""
        if not self._needs_resync:
            self._ops.append(op)

    def add_blocks(self, worker_id: str, epoch: int, hashes: Iterable[bytes]) -> None:
        hashes = list(hashes)
        super().add_blocks(worker_id, epoch, hashes)
        if not hashes:
            return
        for h in hashes:
            self._queue(["HSET", self._blk_key(h), worker_id, epoch])
        self._queue(["SADD", self._wblk_key(worker_id), *(h.hex() for h in hashes)])

    def remove_blocks(self, worker_id: str, epoch: int, hashes: Iterable[bytes]) -> None:
        removed = [h for h in hashes if self._index.get(h, {}).get(worker_id) == epoch]
        super().remove_blocks(worker_id, epoch, removed)
        if not removed:
            return
        for h in removed:
            self._queue(["HDEL", self._blk_key(h), worker_id])
        self._queue(["SREM", self._wblk_key(worker_id), *(h.hex() for h in removed)])

    def purge_worker(self, worker_id: str) -> int:
        owned = list(self._by_worker.get(worker_id, ()))
        count = super().purge_worker(worker_id)
        for h in owned:
            self._queue(["HDEL", self._blk_key(h), worker_id])
        if owned:
            self._queue(["DEL", self._wblk_key(worker_id)])
        return count

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    async def start(self) -> None:
        """Load the index Redis holds (it outlives a scheduler restart), rewrite it, start flushing.

        The rewrite drops partial or malformed keys a crash mid-outage could have left, and any other
        key under the prefix (such as the request records older versions wrote), and rebuilds the
        reverse sets from the index. Unlike later failures, Redis being unreachable here raises:
        a scheduler configured for Redis should not come up without it.
        """
        try:
            async with self._lock:
                await self._load()
                await self._resync()
        except _REDIS_ERRORS as e:
            raise ConnectionError(f"kvstore: cannot load state from Redis at {self._url}: {e}") from e
        self._healthy = True
        self._started = True
        self._flusher = asyncio.create_task(self._run_flusher(), name="kvstore-redis-flusher")

    async def flush(self) -> None:
        """Send what is queued now (or resync if due); never raises for Redis errors."""
        await self._flush_once()

    async def close(self) -> None:
        """Stop the flusher, send what is still queued, close the connection."""
        if self._flusher is not None:
            async with self._lock:  # so the flusher is never cancelled holding commands it took
                self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
            await self._flush_once()
            # Later writes only change memory: nothing would ever send what they queue.
            self._started = False
            self._needs_resync = True
        await self._redis.aclose()

    async def _run_flusher(self) -> None:
        delay = self._flush_interval_s
        idle_s = 0.0
        while True:
            await asyncio.sleep(delay)
            idle_s += delay
            if not (self._ops or self._needs_resync or idle_s >= PROBE_INTERVAL_S):
                continue
            idle_s = 0.0
            ok = await self._flush_once()
            delay = self._flush_interval_s if ok else min(max(2 * delay, 0.05), MAX_BACKOFF_S)

    async def _flush_once(self) -> bool:
        """One flush, resync or idle probe; False on a Redis error (the store is then unhealthy)."""
        if not self._started:  # a resync before start() loaded Redis would wipe what it holds
            return False
        async with self._lock:
            try:
                if self._needs_resync:
                    await self._resync()
                elif not await self._send_queued():
                    logger.warning("kvstore: Redis at %s lost our keys (restarted?); rewriting them", self._url)
                    self._healthy = False
                    await self._resync()
            except _REDIS_ERRORS as e:
                if self._healthy:
                    logger.warning("kvstore: Redis at %s failed (%s); serving from memory, will resync", self._url, e)
                self._healthy = False
                self._needs_resync = True
                self._ops = []
                return False
            if not self._healthy:
                logger.info("kvstore: Redis at %s holds our full state again", self._url)
                self._healthy = True
            return True

    async def _send_queued(self) -> bool:
        """Send the queued commands in one pipeline; False if Redis has lost the sentinel."""
        ops, self._ops = self._ops, []
        if not ops:
            return bool(await self._redis.exists(self._sentinel_key))
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(self._sentinel_key)
        for op in ops:
            pipe.execute_command(*op)
        results = await pipe.execute()
        return bool(results[0])

    async def _resync(self) -> None:
        """Make Redis hold exactly the in-memory state; the sentinel goes last."""
        # The snapshot is taken without yielding, so every write after it is queued and sent later.
        self._needs_resync = False
        self._ops = []
        try:
            ops: list[list] = []
            for h, holders in self._index.items():
                key = self._blk_key(h)
                ops.append(["DEL", key])
                ops.append(["HSET", key, *(x for item in holders.items() for x in item)])
            for worker_id, owned in self._by_worker.items():
                if owned:
                    key = self._wblk_key(worker_id)
                    ops.append(["DEL", key])
                    ops.append(["SADD", key, *(h.hex() for h in owned)])
            wanted = {op[1] for op in ops}
            wanted.add(self._sentinel_key)
            strays = [k async for k in self._redis.scan_iter(match=_glob_escape(self._prefix) + "*", count=1000)]
            strays = [k for k in strays if k not in wanted]
            ops = [["UNLINK", *strays[i : i + CHUNK]] for i in range(0, len(strays), CHUNK)] + ops
            for i in range(0, len(ops), CHUNK):
                pipe = self._redis.pipeline(transaction=False)
                for op in ops[i : i + CHUNK]:
                    pipe.execute_command(*op)
                await pipe.execute()
            await self._redis.set(self._sentinel_key, "1")
        except BaseException:
            self._needs_resync = True
            self._ops = []
            raise

    async def _load(self) -> None:
        """Merge the index Redis holds into memory, skipping keys that do not parse."""
        glob = _glob_escape(self._prefix)
        blk_keys = [k async for k in self._redis.scan_iter(match=glob + "blk:*", count=1000, _type="hash")]
        for keys, entries in await self._hgetall(blk_keys):
            for key, holders in zip(keys, entries):
                try:
                    h = bytes.fromhex(key[len(self._prefix) + 4 :])
                    parsed = {w: int(e) for w, e in holders.items()}
                except ValueError:
                    logger.warning("kvstore: skipping malformed index key %s", key)
                    continue
                for worker_id, epoch in parsed.items():
                    self._index.setdefault(h, {})[worker_id] = epoch
                    self._by_worker.setdefault(worker_id, set()).add(h)

    async def _hgetall(self, keys: list[str]) -> list[tuple[list[str], list[dict[str, str]]]]:
        """``HGETALL`` of every key, CHUNK keys per pipeline."""
        batches = []
        for i in range(0, len(keys), CHUNK):
            chunk = keys[i : i + CHUNK]
            pipe = self._redis.pipeline(transaction=False)
            for key in chunk:
                pipe.hgetall(key)
            batches.append((chunk, await pipe.execute()))
        return batches
