"""The scheduler's kvstore: the prefix-block index, embedded or mirrored to Redis."""

from __future__ import annotations

from metroserve.kvstore.store import MemoryKVStore

__all__ = ["MemoryKVStore", "open_kvstore"]


def open_kvstore(url: str) -> MemoryKVStore:
    """The backend a URL names: "memory" (or empty) embeds the store, "redis://..." uses Redis.

    Redis is imported only when asked for, so the embedded default needs no Redis client.
    """
    if url in ("", "memory"):
        return MemoryKVStore()
    if url.startswith("redis://"):
        from metroserve.kvstore.redis_store import RedisKVStore

        return RedisKVStore(url)
    raise ValueError(f"kvstore url must be 'memory' or 'redis://host:port/db', got {url!r}")
