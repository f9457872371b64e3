"""DraftModelProposer: a smaller model with the same tokenizer drafts k tokens per sequence.

The draft keeps its own paged KV pool with the same number of blocks and block size as the
target's, indexed by the target's block tables. One block id therefore names the same tokens in
both pools, and everything the block manager does (prefix hits, forks with copy-on-write,
preemption, aborts, rollback of rejected drafts) applies to the draft's cache for free. To keep the
two pools in step, the draft runs a forward over every batch the target runs (``mirror``), so any
block the target has computed or cached is also computed in the draft's pool.
"""

from __future__ import annotations

import numpy as np
import torch

from metroserve.common.tokenizer import load_tokenizer
from metroserve.worker.attention import AttentionBackend, BatchLayout, block_tables_to_slots, make_attention_backend
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.model_files import resolve_model_dir
from metroserve.worker.model_loader import load_model
from metroserve.worker.sampler import Sampler
from metroserve.worker.sequence import Sequence


class DraftModelProposer:
    def __init__(self, model: str, target_vocab: dict[str, int], dtype: torch.dtype, device: torch.device,
                 attention_backend: str):
        self.model_dir = resolve_model_dir(model)
        self.model = load_model(self.model_dir, dtype, device)
        vocab = load_tokenizer(self.model_dir).get_vocab()
        if vocab != target_vocab:
            raise ValueError(f"draft model {model!r} does not share the target's tokenizer "
                             f"({len(vocab)} vs {len(target_vocab)} tokens, or different ids)")
        self.dtype, self.device = dtype, device
        self.attention_backend = attention_backend
        # Set by init_cache, once the target's pool size is known.
        self.attention: AttentionBackend | None = None
        self.kv_cache: KVCache | None = None
        self.sampler: Sampler | None = None

    def bytes_per_block(self, block_size: int) -> int:
        cfg = self.model.cfg
        return KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def init_cache(self, num_blocks: int, block_size: int, sampler: Sampler) -> None:
        """Allocate the draft pool once the target's block count is known."""
        cfg = self.model.cfg
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                self.dtype, self.device)
        self.attention = make_attention_backend(self.attention_backend, block_size, self.device, self.dtype,
                                                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.sampler = sampler

    def _pool(self) -> tuple[AttentionBackend, KVCache, Sampler]:
        assert self.attention is not None and self.kv_cache is not None and self.sampler is not None, \
            "init_cache() first"
        return self.attention, self.kv_cache, self.sampler

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """The target's copy-on-write block copies, applied to the draft's pool too."""
        self._pool()[1].copy_blocks(blocks_to_copy)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> None:
        """Write the draft's K/V for the tokens of the target's step (no logits needed)."""
        attention, kv_cache, _ = self._pool()
        self.model(input_ids, positions, attention, kv_cache, self.model.prepare_attention(attention, layout))

    def propose(self, seqs: list[Sequence]) -> None:
        """Fill seq.spec_token_ids with seq.num_lookahead_tokens drafts, and seq.draft_probs for sampled rows.

        The slots the drafts' K/V go to are already allocated: the batcher scheduled 1 + lookahead
        tokens for each of these sequences. Draft j of a sequence with L tokens sits at position L + j;
        the draft's forward j reads the token at position L - 1 + j.
        """
        attention, kv_cache, sampler = self._pool()
        for s in seqs:
            s.spec_token_ids = []
        sampled = [s for s in seqs if not s.request.params.greedy]
        q_rows: dict[int, list[torch.Tensor]] = {id(s): [] for s in sampled}
        bs = kv_cache.block_size
        for j in range(max(s.num_lookahead_tokens for s in seqs)):
            active = [s for s in seqs if s.num_lookahead_tokens > j]
            tokens = [s.spec_token_ids[-1] if j else s.token_ids[-1] for s in active]
            pos = np.asarray([s.num_tokens - 1 + j for s in active], dtype=np.int64)
            tables = [s.block_table for s in active]
            table_tensor, slots = block_tables_to_slots(tables, np.arange(len(active)), pos, bs, self.device)
            layout = BatchLayout(query_start=list(range(len(active))), query_lens=[1] * len(active),
                                 seq_lens=(pos + 1).tolist(), block_tables=tables,
                                 block_table_tensor=table_tensor, slot_mapping=slots)
            positions = torch.from_numpy(pos).to(self.device)
            hidden = self.model(torch.tensor(tokens, device=self.device), positions, attention, kv_cache,
                                self.model.prepare_attention(attention, layout))
            logits = sampler.process_logits(self.model.compute_logits(hidden), active)
            next_tokens = logits.argmax(dim=-1)
            rows = [i for i, s in enumerate(active) if not s.request.params.greedy]
            if rows:
                q = Sampler.probs(logits[rows], [active[i].request.params for i in rows])
                next_tokens[rows] = torch.multinomial(q, 1, generator=sampler.generator)[:, 0]
                for r, i in enumerate(rows):
                    q_rows[id(active[i])].append(q[r])
            for s, t in zip(active, next_tokens.tolist()):
                s.spec_token_ids.append(t)
        for s in sampled:
            s.draft_probs = torch.stack(q_rows[id(s)])
