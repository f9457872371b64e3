"""BlockManager: ref-counted KV blocks with automatic prefix caching.

Every full block of a sequence gets a chained content hash (``metroserve.common.block_hash``). A block whose
ref count drops to zero keeps its contents and its hash: it sits in the free queue, reusable by any
later sequence with the same prefix until it is evicted by an allocation. The free queue is LRU:
a finished sequence releases its chain tail first, so a shared system prompt (the chain's head)
survives longest. Blocks that hold nothing reusable go to the front and are taken first.

With a sliding window on every layer (Mistral, Phi-3), a block no future query can see is released
while its sequence runs (release_out_of_window): its table entry then names the null block, an
extra pool block that is never allocated and never read, so positions still index the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from metroserve.common.block_hash import ROOT_HASH, BlockHash, hash_block
from metroserve.worker.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cache
    evictions: int = 0  # cached blocks whose contents were overwritten


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False, sliding_window: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Every layer's window, when every layer has one: blocks behind it are released early.
        self.sliding_window = sliding_window
        self.null_block = num_blocks  # the pool's extra block (KVCache is sized num_blocks + 1 then)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> block id holding that content
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.stats = PrefixCacheStats()
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next step
        # Hashes that entered / left the cache since take_events(): the worker reports them so the
        # scheduler's prefix-block index knows which worker holds which prefix.
        self.record_events = record_events
        self.stored_events: list[BlockHash] = []
        self.removed_events: list[BlockHash] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of its tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else ROOT_HASH
        extra = seq.request.extra_keys
        for start in range(len(hashes) * bs, seq.num_tokens - bs + 1, bs):
            parent = hash_block(parent, seq.token_ids[start : start + bs], extra)
            hashes.append(parent)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq, leaving at least its last token to compute."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed, so later prefixes can hit them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self.update_block_hashes(seq)
        for i in range(seq.num_cached_blocks, num_full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            # Two sequences may compute the same content at once; the first one registered wins
            # and the duplicate stays unhashed (it goes first when freed).
            if self.block_hash[block] is None and h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
                if self.record_events:
                    self.stored_events.append(h)
        seq.num_cached_blocks = num_full

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) block hashes since the last call."""
        events = self.stored_events, self.removed_events
        self.stored_events, self.removed_events = [], []
        return events

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Give seq the blocks for its cached prefix plus num_new_tokens more; False if they don't fit.

        A write into a block that a fork shares is redirected to a private copy; the (src, dst)
        pair is queued in pending_copies for the model runner to copy before the forward.
        """
        num_needed = self.blocks_needed(seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens)
        num_new_blocks = num_needed - len(seq.block_table) - len(cached_blocks)
        # A hit's blocks behind the window of its first computed token stay where they are.
        behind = self._behind_window(len(cached_blocks) * self.block_size) if cached_blocks else 0
        # Cached blocks with no owner sit in the free queue: using them takes them out of it.
        num_revived = sum(1 for b in cached_blocks[behind:] if self.ref_cnt[b] == 0)
        cow_index = self._shared_write_block(seq)
        if num_new_blocks + num_revived + (cow_index is not None) > len(self.free_queue):
            return False
        if cow_index is not None:
            src, dst = seq.block_table[cow_index], self._take_free_block()
            self.ref_cnt[src] -= 1
            seq.block_table[cow_index] = dst
            self.pending_copies.append((src, dst))
        for block in cached_blocks[behind:]:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1
        seq.block_table.extend([self.null_block] * behind + list(cached_blocks[behind:]))
        seq.num_released_blocks += behind
        if cached_blocks:
            seq.num_cached_blocks = len(seq.block_table)
        while len(seq.block_table) < num_needed:
            seq.block_table.append(self._take_free_block())
        return True

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index of the partly filled block seq writes next, if a fork shares it."""
        pos = seq.num_computed_tokens
        index = pos // self.block_size
        if pos % self.block_size == 0 or index >= len(seq.block_table):
            return None
        return index if self.ref_cnt[seq.block_table[index]] > 1 else None

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            # Its cached contents are about to be overwritten.
            del self.cached[h]
            self.block_hash[block] = None
            self.stats.evictions += 1
            if self.record_events:
                self.removed_events.append(h)
        self.ref_cnt[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, chain tail first so the shared head stays cached longest."""
        for block in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_released_blocks = 0

    def release_out_of_window(self, seq: Sequence) -> None:
        """Release seq's leading blocks that no query from its next position on can see: a query at
        position p sees keys p - window + 1 .. p. Call after the step's blocks were cached."""
        for i in range(seq.num_released_blocks, self._behind_window(seq.num_computed_tokens)):
            self._release(seq.block_table[i])
            seq.block_table[i] = self.null_block
            seq.num_released_blocks = i + 1

    def _behind_window(self, num_computed_tokens: int) -> int:
        """How many leading blocks no query at position num_computed_tokens or later can see."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def _release(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is None:
                self.free_queue.move_to_end(block, last=False)

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past seq's computed tokens: rejected drafts' slots roll back."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]

    # -- forks (n > 1) -----------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks; a shared partial block is copied on first write."""
        for block in parent.block_table[parent.num_released_blocks :]:
            self.ref_cnt[block] += 1
        child.block_table = list(parent.block_table)
        child.num_released_blocks = parent.num_released_blocks
