"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples.

This is the hot path. Inputs are built with numpy over whole sequences (no per-token Python),
logits are computed only for rows that will be sampled, and nothing here touches the network,
the tokenizer or a log.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention import AttentionBackend, BatchLayout
from worker.batcher import ScheduledBatch
from worker.kv_cache import KVCache
from worker.model import LlamaForCausalLM
from worker.sampler import Sampler, SamplerOutput
from worker.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, attention: AttentionBackend, sampler: Sampler,
                 device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[int], sample_seqs: list[Sequence]) -> SamplerOutput:
        """Run one step. sample_rows[j] is the batch index whose last token's logits sample_seqs[j] samples from."""
        self.kv_cache.copy_blocks(batch.blocks_to_copy)
        input_ids, positions, layout = self._prepare(batch)
        metadata = self.attention.prepare(layout)
        hidden = self.model(input_ids, positions, self.attention, self.kv_cache, metadata)
        if not sample_seqs:
            return SamplerOutput([], [])
        last_token = [layout.query_start[i] + layout.query_lens[i] - 1 for i in sample_rows]
        logits = self.model.compute_logits(hidden[torch.tensor(last_token, device=self.device)])
        return self.sampler(logits, sample_seqs)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
        bs = self.block_size
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.asarray([s.num_computed_tokens for s in batch.seqs], dtype=np.int64)
        query_start = np.zeros(len(num_new) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        total = int(query_start[-1])
        # Position of every token: its sequence's start plus its offset inside the chunk.
        seq_of_token = np.repeat(np.arange(len(num_new)), num_new)
        positions = starts[seq_of_token] + (np.arange(total) - query_start[seq_of_token])
        ids: list[int] = []
        for seq, start, n in zip(batch.seqs, starts.tolist(), batch.num_new_tokens):
            ids.extend(seq.token_ids[start : start + n])
        tables = [s.block_table for s in batch.seqs]
        width = max(len(t) for t in tables)
        table_arr = np.zeros((len(tables), width), dtype=np.int64)
        for i, t in enumerate(tables):
            table_arr[i, : len(t)] = t
        slots = table_arr[seq_of_token, positions // bs] * bs + positions % bs
        layout = BatchLayout(
            query_start=query_start[:-1].tolist(),
            query_lens=batch.num_new_tokens,
            seq_lens=(starts + num_new).tolist(),
            block_tables=tables,
            block_table_tensor=torch.from_numpy(table_arr).to(self.device),
            slot_mapping=torch.from_numpy(slots).to(self.device),
        )
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.from_numpy(positions).to(self.device), layout)
