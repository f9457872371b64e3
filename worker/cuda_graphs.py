"""CUDA graphs for decode steps.

A decode step of a small model is mostly kernel-launch overhead: hundreds of small kernels for a
few microseconds of work each. Capturing the model's forward once per batch size and replaying it
turns those launches into one. A step whose sequences all decode one token (no prefill chunk, no
drafts to verify) and that fits the largest captured size runs padded to the next captured size:
the padded rows have slot -1 and query length 0, so the Triton kernels write and read nothing for
them. Graphs read their inputs from static buffers, which each step fills before the replay.

Graphs need the Triton backend (its metadata is all tensors; the torch backend plans on the host).
On a CPU the same padded path runs eagerly instead of replaying, so the padding is tested without
a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tqdm import tqdm

from metroserve.worker.attention import BatchLayout
from metroserve.worker.attention.triton import TritonAttention, TritonMetadata
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.model import AttentionMetadata, DecoderForCausalLM

# 1, 2, 4, then steps of 8 up to 32 and of 16 beyond, as vLLM does: a padded step wastes little.
CAPTURE_SIZES = [1, 2, 4] + list(range(8, 32, 8)) + list(range(32, 513, 16))


class CudaGraphRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, attention: TritonAttention, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model, self.kv_cache, self.attention, self.device = model, kv_cache, attention, device
        self.sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.long, device=device)
        self.lens = torch.zeros(2 * n + 1, dtype=torch.int32, device=device)  # seq_lens, then query_start
        self.tile_seq = torch.arange(n, dtype=torch.int32, device=device)  # one query tile per sequence
        self.tile_start = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def metadata(self, size: int) -> AttentionMetadata:
        """The model's per-window metadata over the static buffers: the window is a kernel scalar."""
        n = self.sizes[-1]
        meta = TritonMetadata(self.slot_mapping[:size], self.block_tables[:size], self.lens[:size],
                              self.lens[n : n + size + 1], self.tile_seq[:size], self.tile_start[:size],
                              self.attention.decode_block_q(), self.attention.decode_segments(size))
        return {w: meta if w is None else dataclasses.replace(meta, sliding_window=w) for w in self.model.windows}

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first so the smaller ones reuse its memory pool."""
        pool = None
        for size in tqdm(reversed(self.sizes), total=len(self.sizes), desc="capturing CUDA graphs", unit="graph"):
            meta = self.metadata(size)
            # Warm-up outside the graph compiles the kernels and sets up cuBLAS for this shape.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.model(self.input_ids[:size], self.positions[:size], self.attention, self.kv_cache, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size], self.attention,
                                                self.kv_cache, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, layout: BatchLayout) -> bool:
        return (len(layout.query_lens) <= self.sizes[-1] and max(layout.query_lens) == 1
                and layout.block_table_tensor.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Hidden states of a decode-only step, computed at the next captured size."""
        b = len(layout.query_lens)
        size = next(s for s in self.sizes if s >= b)
        n = self.sizes[-1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(layout.slot_mapping)
        self.slot_mapping[b:size].fill_(-1)
        self.block_tables[:b, : layout.block_table_tensor.shape[1]].copy_(layout.block_table_tensor)
        # Padded rows: context 0 and an empty query (query_start stays at b).
        lens = np.zeros(2 * n + 1, dtype=np.int32)
        lens[:b] = layout.seq_lens
        lens[n : n + size + 1] = np.minimum(np.arange(size + 1), b)
        self.lens.copy_(torch.from_numpy(lens))
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:b]
        return self.model(self.input_ids[:size], self.positions[:size], self.attention, self.kv_cache,
                          self.metadata(size))[:b]
