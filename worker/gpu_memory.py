"""How much GPU memory the KV pool may take: the budget minus a profiled worst-case step.

The weights are loaded first. Then one step of the largest size the batcher can schedule
(max_num_batched_tokens prompt tokens, logits for max_num_seqs rows) runs against a throwaway
pool, and its peak allocation is what the KV pool must leave free. This is vLLM's method; a fixed
margin either wastes gigabytes on a large card or runs out on a long-context model.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from metroserve.worker.attention import AttentionBackend, BatchLayout, block_tables_to_slots
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.model import DecoderForCausalLM

logger = logging.getLogger(__name__)


def profile_batch(num_tokens: int, max_model_len: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, BatchLayout, int]:
    """The largest step: num_tokens prompt tokens as prompts of at most max_model_len, each in its
    own blocks. Returns input ids, positions, the layout and the number of blocks it needs."""
    lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    blocks = [-(-n // block_size) for n in lens]
    first_block = np.cumsum([0] + blocks[:-1])
    tables = [list(range(f, f + b)) for f, b in zip(first_block.tolist(), blocks)]
    positions = np.concatenate([np.arange(n) for n in lens])
    table_tensor, slots = block_tables_to_slots(tables, np.repeat(np.arange(len(lens)), lens), positions, block_size,
                                                device)
    layout = BatchLayout(np.cumsum([0] + lens[:-1]).tolist(), lens, lens, tables, table_tensor, slots)
    return (torch.zeros(num_tokens, dtype=torch.long, device=device), torch.from_numpy(positions).to(device), layout,
            sum(blocks))


@torch.inference_mode()
def profile_step_peak(model: DecoderForCausalLM, attention: AttentionBackend, num_tokens: int, max_model_len: int,
                      num_sampled: int, block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Peak bytes allocated on the device during one max-size step, not counting its throwaway pool."""
    cfg = model.cfg
    input_ids, positions, layout, num_blocks = profile_batch(num_tokens, max_model_len, block_size, device)
    pool = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    pool_bytes = pool.k.numel() * pool.k.element_size() * 2
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    hidden = model(input_ids, positions, attention, pool, model.prepare_attention(attention, layout))
    model.compute_logits(hidden[: min(num_sampled, num_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - pool_bytes
    del pool, hidden
    torch.cuda.empty_cache()
    return peak


def kv_budget_bytes(peak_bytes: int, gpu_memory_utilization: float, device: torch.device) -> int:
    """What the pool may use: the card's memory times the utilization, less the profiled peak.

    Memory other processes hold on the card counts against the budget, as it is not ours to use."""
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization) - peak_bytes - max(0, others)
    logger.info("GPU memory: %.1f GiB total, %.2f GiB peak step (weights included), %.1f GiB for the KV pool",
                total / 2**30, peak_bytes / 2**30, budget / 2**30)
    return budget
