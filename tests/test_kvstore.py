"""The kvstore: epochs, prefix matching and purging in the block index, for both backends; for
Redis also loading the index back after a restart, the pipelined write path and recovery from
Redis restarts and outages."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis
import redis.asyncio.client

from metroserve.common.block_hash import hash_prompt_blocks
from metroserve.kvstore import MemoryKVStore, open_kvstore
from metroserve.kvstore.redis_store import RedisKVStore
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

H = hash_prompt_blocks(list(range(16 * 64)), 16)  # 64 chained block hashes


# ---- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


@pytest.fixture(params=["memory", "redis"])
def make_store(request) -> Callable[[], MemoryKVStore]:
    """A factory of unstarted stores; every Redis store of one test shares one fresh key prefix."""
    if request.param == "memory":
        return MemoryKVStore
    server = request.getfixturevalue("redis_server")
    prefix = _prefix()
    return lambda: RedisKVStore(server.url, key_prefix=prefix)


def run(store: MemoryKVStore, body: Callable[[MemoryKVStore], Awaitable[None]]) -> None:
    async def main() -> None:
        await store.start()
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(main())


async def eventually(cond: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.02)


def dump(url: str, prefix: str) -> dict:
    """Everything the store wrote under ``prefix``, decoded, read with a separate client."""
    index: dict[bytes, dict[str, int]] = {}
    reverse: dict[str, set[bytes]] = {}
    other: set[str] = set()
    with redis.Redis.from_url(url, decode_responses=True) as r:
        for key in r.scan_iter(match=prefix + "*"):
            rest = key[len(prefix) :]
            if rest.startswith("blk:"):
                index[bytes.fromhex(rest[4:])] = {w: int(e) for w, e in r.hgetall(key).items()}
            elif rest.startswith("wblk:"):
                reverse[rest[5:]] = {bytes.fromhex(x) for x in r.smembers(key)}
            else:
                other.add(rest)
    return {"index": index, "reverse": reverse, "other": other}


def expected_dump(index: dict[bytes, dict[str, int]]) -> dict:
    reverse: dict[str, set[bytes]] = {}
    for h, holders in index.items():
        for w in holders:
            reverse.setdefault(w, set()).add(h)
    return {"index": index, "reverse": reverse, "other": {"sentinel"}}


def dump_or_none(url: str, prefix: str) -> dict | None:
    try:
        return dump(url, prefix)
    except redis.exceptions.ConnectionError:
        return None


# ---- both backends ------------------------------------------------------------------------------


def test_stale_epoch_never_matches(make_store):
    async def body(s: MemoryKVStore) -> None:
        s.add_blocks("w1", 1, H[:4])
        assert s.match_prefix(H[:4], {"w1": 1}) == {"w1": 4}
        assert s.match_prefix(H[:4], {"w1": 2}) == {}  # w1 restarted: its epoch-1 blocks are gone
        s.add_blocks("w1", 2, H[:2])  # the new incarnation reports two blocks
        assert s.match_prefix(H[:4], {"w1": 2}) == {"w1": 2}
        assert s.match_prefix(H[:4], {"w1": 1}) == {}
        assert s.num_blocks("w1") == 4

    run(make_store(), body)


def test_remove_only_removes_the_given_epoch(make_store):
    async def body(s: MemoryKVStore) -> None:
        s.add_blocks("w1", 1, H[:4])
        s.remove_blocks("w1", 2, H[:4])  # a different epoch: nothing of epoch 1 goes
        assert s.match_prefix(H[:4], {"w1": 1}) == {"w1": 4}
        s.add_blocks("w1", 2, H[:1])
        s.remove_blocks("w1", 1, H[:2])  # H[0] is now under epoch 2 and stays; H[1] goes
        assert s.match_prefix(H[:4], {"w1": 2}) == {"w1": 1}
        assert s.match_prefix(H[2:4], {"w1": 1}) == {"w1": 2}
        assert s.num_blocks("w1") == 3
        s.remove_blocks("w1", 1, H[2:4])
        s.remove_blocks("w1", 2, H[:1])
        assert s.num_blocks("w1") == 0
        assert s.match_prefix(H[:4], {"w1": 1, "w1x": 2}) == {}
        await s.flush()
        if isinstance(s, RedisKVStore):
            assert dump(s._url, s._prefix) == expected_dump({})

    run(make_store(), body)


def test_match_prefix_stops_at_the_first_gap_per_worker(make_store):
    async def body(s: MemoryKVStore) -> None:
        s.add_blocks("w1", 1, [H[0], H[1], H[3], H[4]])  # gap at H[2]
        s.add_blocks("w2", 7, H[:5])
        s.add_blocks("w3", 1, H[1:5])  # misses the first block
        s.add_blocks("w4", 1, H[:5])  # not live
        live = {"w1": 1, "w2": 7, "w3": 1, "w5": 1}
        assert s.match_prefix(H[:5], live) == {"w1": 2, "w2": 5}
        assert s.match_prefix(H[:3], live) == {"w1": 2, "w2": 3}
        assert s.match_prefix(H[1:5], live) == {"w1": 1, "w2": 4, "w3": 4}
        assert s.match_prefix([H[10]] + H[:5], live) == {}
        assert s.match_prefix([], live) == {}
        assert s.match_prefix(H[:5], {}) == {}

    run(make_store(), body)


def test_purge_worker_drops_only_that_worker(make_store):
    async def body(s: MemoryKVStore) -> None:
        s.add_blocks("w1", 1, H[:5])
        s.add_blocks("w1", 2, H[5:6])
        s.add_blocks("w2", 1, H[3:8])
        assert s.purge_worker("w1") == 6
        assert s.purge_worker("w1") == 0
        assert s.num_blocks("w1") == 0
        assert s.num_blocks("w2") == 5
        assert s.match_prefix(H[:8], {"w1": 1, "w2": 1}) == {}
        assert s.match_prefix(H[3:8], {"w1": 1, "w2": 1}) == {"w2": 5}
        await s.flush()
        if isinstance(s, RedisKVStore):
            assert dump(s._url, s._prefix) == expected_dump({h: {"w2": 1} for h in H[3:8]})

    run(make_store(), body)


def test_index_agrees_with_a_naive_model(make_store):
    """Random adds, removes and purges against a per-worker dict; Redis must mirror the result."""
    rng = random.Random(0)
    hashes = H[:12]

    async def body(s: MemoryKVStore) -> None:
        model: dict[str, dict[bytes, int]] = {}  # worker -> {hash: epoch}
        for _ in range(400):
            w, epoch = rng.choice(["w1", "w2", "w3"]), rng.choice([1, 2])
            picked = rng.sample(hashes, rng.randint(0, 6))
            op = rng.random()
            if op < 0.55:
                s.add_blocks(w, epoch, picked)
                model.setdefault(w, {}).update((h, epoch) for h in picked)
            elif op < 0.95:
                s.remove_blocks(w, epoch, picked)
                held = model.get(w, {})
                for h in picked:
                    if held.get(h) == epoch:
                        del held[h]
            else:
                assert s.purge_worker(w) == len(model.pop(w, {}))
            live = {x: rng.choice([1, 2]) for x in ["w1", "w2", "w3", "w4"]}
            prompt = hashes[: rng.randint(0, 12)]
            want = {}
            for x, e in live.items():
                n = 0
                while n < len(prompt) and model.get(x, {}).get(prompt[n]) == e:
                    n += 1
                if n:
                    want[x] = n
            assert s.match_prefix(prompt, live) == want
            assert all(s.num_blocks(x) == len(model.get(x, {})) for x in live)
        if isinstance(s, RedisKVStore):
            await s.flush()
            index: dict[bytes, dict[str, int]] = {}
            for x, held in model.items():
                for h, e in held.items():
                    index.setdefault(h, {})[x] = e
            assert dump(s._url, s._prefix) == expected_dump(index)

    run(make_store(), body)


# ---- Redis --------------------------------------------------------------------------------------


def test_open_kvstore_picks_the_backend():
    assert type(open_kvstore("memory")) is MemoryKVStore
    assert type(open_kvstore("")) is MemoryKVStore
    assert type(open_kvstore("redis://127.0.0.1:1/0")) is RedisKVStore
    with pytest.raises(ValueError, match="kvstore url"):
        open_kvstore("etcd://somewhere")


def test_start_fails_clearly_without_redis():
    with RedisServer() as server:
        url = server.url
    with pytest.raises(ConnectionError, match="cannot load state from Redis"):
        asyncio.run(RedisKVStore(url).start())


def test_a_fresh_store_loads_the_same_index(redis_server):
    prefix = _prefix()

    async def main() -> None:
        first = RedisKVStore(redis_server.url, key_prefix=prefix)
        await first.start()
        first.add_blocks("w1", 1, H[:10])
        first.add_blocks("w2", 4, H[:3])
        first.remove_blocks("w2", 4, H[1:2])
        await first.close()

        second = RedisKVStore(redis_server.url, key_prefix=prefix)
        await second.start()
        try:
            assert second.match_prefix(H[:10], {"w1": 1, "w2": 4}) == {"w1": 10, "w2": 1}
            assert second.match_prefix(H[2:3], {"w1": 1, "w2": 4}) == {"w1": 1, "w2": 1}
            assert (second.num_blocks("w1"), second.num_blocks("w2")) == (10, 2)
            assert second.healthy
        finally:
            await second.close()

    asyncio.run(main())


def test_write_path_is_pipelined(redis_server, monkeypatch):
    executions = 0
    real_execute = redis.asyncio.client.Pipeline.execute

    async def counting_execute(self, *args, **kwargs):
        nonlocal executions
        executions += 1
        return await real_execute(self, *args, **kwargs)

    prefix = _prefix()

    async def main() -> None:
        store = RedisKVStore(redis_server.url, key_prefix=prefix)
        await store.start()
        monkeypatch.setattr(redis.asyncio.client.Pipeline, "execute", counting_execute)
        for i in range(1000):
            store.add_blocks("w1", 1, [i.to_bytes(16, "little")])
        store.remove_blocks("w1", 1, [i.to_bytes(16, "little") for i in range(0, 1000, 2)])
        await store.flush()
        try:
            assert executions <= 2, executions  # the flush, and at most one from the flusher task
            with redis.Redis.from_url(redis_server.url, decode_responses=True) as r:
                assert r.scard(prefix + "wblk:w1") == 500
                assert r.hgetall(prefix + "blk:" + (1).to_bytes(16, "little").hex()) == {"w1": "1"}
                assert not r.exists(prefix + "blk:" + (2).to_bytes(16, "little").hex())
            assert store.num_blocks("w1") == 500
        finally:
            await store.close()

    asyncio.run(main())


def _fill(s: RedisKVStore) -> dict[bytes, dict[str, int]]:
    """Some index entries; returns the index they make."""
    s.add_blocks("w1", 1, H[:40])
    s.add_blocks("w2", 3, H[20:50])
    index: dict[bytes, dict[str, int]] = {}
    for h in H[:40]:
        index.setdefault(h, {})["w1"] = 1
    for h in H[20:50]:
        index.setdefault(h, {})["w2"] = 3
    return index


def test_redis_restart_mid_run_recovers_the_full_state():
    with RedisServer() as server:
        prefix = _prefix()

        async def main() -> None:
            s = RedisKVStore(server.url, key_prefix=prefix)
            await s.start()
            try:
                index = _fill(s)
                await s.flush()
                assert dump(server.url, prefix) == expected_dump(index)

                server.restart()  # empty again, same port
                # Serving goes on: every call works and reads come from memory.
                for step in range(50):
                    s.add_blocks("w2", 3, [H[50 + step % 10]])
                    await asyncio.sleep(0)
                for h in H[50:60]:
                    index[h] = {"w2": 3}
                s.remove_blocks("w1", 1, H[30:40])
                for h in H[30:40]:
                    del index[h]["w1"]
                assert s.match_prefix(H[:60], {"w1": 1, "w2": 3}) == {"w1": 30}

                want = expected_dump(index)
                await eventually(lambda: dump_or_none(server.url, prefix) == want, "Redis holds the full state")
                await eventually(lambda: s.healthy, "the store is healthy")
            finally:
                await s.close()

            fresh = RedisKVStore(server.url, key_prefix=prefix)
            await fresh.start()
            try:
                assert fresh.match_prefix(H[:60], {"w1": 1, "w2": 3}) == {"w1": 30}
                assert fresh.match_prefix(H[20:60], {"w2": 3}) == {"w2": 40}
                assert (fresh.num_blocks("w1"), fresh.num_blocks("w2")) == (30, 40)
            finally:
                await fresh.close()

        asyncio.run(main())


@pytest.mark.parametrize("write_after", [True, False], ids=["on-next-write", "while-idle"])
def test_data_lost_without_a_disconnect_is_rewritten(redis_server, write_after):
    """FLUSHDB keeps the store's connection up, like a restart the client reconnected across."""
    prefix = _prefix()

    async def main() -> None:
        s = RedisKVStore(redis_server.url, key_prefix=prefix)
        await s.start()
        try:
            index = _fill(s)
            await s.flush()
            with redis.Redis.from_url(redis_server.url) as r:
                for key in r.scan_iter(match=prefix + "*"):
                    r.delete(key)
            if write_after:
                s.add_blocks("w3", 1, H[60:61])
                index[H[60]] = {"w3": 1}
                await s.flush()
                assert dump(redis_server.url, prefix) == expected_dump(index)
            else:
                want = expected_dump(index)
                await eventually(lambda: dump(redis_server.url, prefix) == want, "the idle probe rewrote Redis")
            assert s.healthy
        finally:
            await s.close()

    asyncio.run(main())


def test_outage_keeps_serving_and_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="metroserve.kvstore.redis_store")
    with RedisServer() as server:
        prefix = _prefix()

        async def main() -> None:
            s = RedisKVStore(server.url, key_prefix=prefix)
            await s.start()
            try:
                index = _fill(s)
                await s.flush()
                server.stop()
                s.remove_blocks("w2", 3, H[45:50])
                for h in H[45:50]:
                    del index[h]
                await eventually(lambda: not s.healthy, "the store notices the outage")
                for step in range(5):  # writes and forced flushes during the outage never raise
                    s.add_blocks("w3", 1, [H[60 + step % 4]])
                    await s.flush()
                for h in H[60:64]:
                    index[h] = {"w3": 1}
                assert s.match_prefix(H[60:64], {"w3": 1}) == {"w3": 4}
                assert s.match_prefix(H[20:50], {"w2": 3}) == {"w2": 25}
                assert not s.healthy

                server.start()
                want = expected_dump(index)
                await eventually(lambda: dump_or_none(server.url, prefix) == want, "Redis holds the full state")
                await eventually(lambda: s.healthy, "the store is healthy")
            finally:
                await s.close()

        asyncio.run(main())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_resync_after_a_failed_flush_drops_what_memory_no_longer_has(redis_server, monkeypatch):
    """A flush that fails while Redis keeps its data: the resync must delete, not only rewrite."""
    prefix = _prefix()

    async def failing_execute(self, *args, **kwargs):
        raise redis.exceptions.ConnectionError("injected")

    async def main() -> None:
        s = RedisKVStore(redis_server.url, key_prefix=prefix)
        await s.start()
        try:
            before = expected_dump(_fill(s))
            await s.flush()
            monkeypatch.setattr(redis.asyncio.client.Pipeline, "execute", failing_execute)
            s.purge_worker("w2")
            s.remove_blocks("w1", 1, H[:5])
            await s.flush()
            assert not s.healthy
            assert dump(redis_server.url, prefix) == before  # Redis still has the old state
            monkeypatch.undo()
            await s.flush()
            assert s.healthy
            assert dump(redis_server.url, prefix) == expected_dump({h: {"w1": 1} for h in H[5:40]})
        finally:
            await s.close()

    asyncio.run(main())


def test_start_drops_malformed_and_foreign_keys(redis_server):
    prefix = _prefix()
    with redis.Redis.from_url(redis_server.url) as r:
        r.hset(prefix + "blk:not-hex", "w1", 1)
        r.hset(prefix + "blk:" + H[0].hex(), mapping={"w1": 1, "w2": "x"})
        r.sadd(prefix + "wblk:w9", H[1].hex())  # a reverse entry the index does not back
        # Keys this store never writes, like the request records of older versions.
        r.hset(prefix + "req:r1", "status", '"running"')
        r.rpush(prefix + "req:r1:out:0", 1, 2)

    async def main() -> None:
        s = RedisKVStore(redis_server.url, key_prefix=prefix)
        await s.start()
        try:
            assert s.num_blocks("w1") == 0
            assert s.num_blocks("w9") == 0
            assert dump(redis_server.url, prefix) == expected_dump({})
        finally:
            await s.close()

    asyncio.run(main())
