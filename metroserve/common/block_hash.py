"""The prefix-cache block hash: the one definition shared by workers and the scheduler.

A full KV block is identified by a chained hash of (parent block's hash, the block's token ids,
extra keys). Chaining makes a block's hash name its whole prefix, so equal hashes mean equal KV
contents. Extra keys (for example a per-request ``cache_salt``) separate caches that must never
be shared. The scheduler hashes prompts with these same functions to score placement, so the
encoding is pinned by golden vectors in tests/test_block_hash.py: changing it is a protocol
change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes

# The parent of a sequence's first block: a fixed value rather than "no parent", so every
# block is hashed the same way.
ROOT_HASH: BlockHash = b"\x00" * 16


def extra_keys_for(cache_salt: str | None) -> tuple[str, ...]:
    """The extra keys of a request's blocks: its cache_salt, if any."""
    return (cache_salt,) if cache_salt else ()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash of one full block: sha256 over parent, int64 little-endian token ids, extra keys; 16 bytes."""
    return _hash_block_bytes(parent, np.asarray(token_ids, dtype="<i8").tobytes(), _encode_keys(extra_keys))


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    parent: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block has none.
    The same bytes hash_block hashes, converted once for the whole prompt (the scheduler hashes
    every prompt it places)."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    keys = _encode_keys(extra_keys)
    step = 8 * block_size
    hashes: list[BlockHash] = []
    for start in range(0, len(data) - step + 1, step):
        parent = _hash_block_bytes(parent, data[start:start + step], keys)
        hashes.append(parent)
    return hashes


def _encode_keys(extra_keys: Sequence[str]) -> bytes:
    """Each key length-prefixed, so ("ab", "c") and ("a", "bc") differ."""
    parts = []
    for key in extra_keys:
        encoded = key.encode("utf-8")
        parts.append(len(encoded).to_bytes(4, "little") + encoded)
    return b"".join(parts)


def _hash_block_bytes(parent: BlockHash, token_bytes: bytes, encoded_keys: bytes) -> BlockHash:
    return hashlib.sha256(parent + token_bytes + encoded_keys).digest()[:16]
