"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples.

This is the hot path. Inputs are built with numpy over whole sequences (no per-token Python),
logits are computed only for rows that will be sampled, and nothing here touches the network,
the tokenizer or a log. With speculative decoding it also runs the draft model (proposals, and a
mirror of every target forward into the draft's KV pool) and verifies the drafts.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from metroserve.worker.attention import AttentionBackend, BatchLayout, block_tables_to_slots
from metroserve.worker.batcher import ScheduledBatch
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.model import DecoderForCausalLM
from metroserve.worker.sampler import Sampler
from metroserve.worker.sequence import Sequence
from metroserve.worker.spec_decode.draft_proposer import DraftModelProposer
from metroserve.worker.spec_decode.rejection_sampler import RejectionSampler

if TYPE_CHECKING:
    from metroserve.worker.cuda_graphs import CudaGraphRunner
    from metroserve.worker.structured_output import StructuredOutputs


# Prompt positions whose full-vocabulary logits are materialised at once for prompt logprobs.
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class StepOutput:
    token_ids: list[list[int]]  # per sampled sequence: one token, or accepted drafts + one
    logprobs: list[dict[int, float] | None]  # per sampled sequence (never speculating ones)
    # (sequence, logprobs of the prompt tokens its chunk predicted, in order) for prefill chunks of
    # requests that asked for prompt logprobs
    prompt_logprobs: list[tuple[Sequence, list[dict[int, float]]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, attention: AttentionBackend, sampler: Sampler,
                 device: torch.device, drafter: DraftModelProposer | None = None,
                 graphs: CudaGraphRunner | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler)
        self.drafter = drafter
        self.graphs = graphs  # decode-only steps replay a captured CUDA graph
        self.device = device
        self.block_size = kv_cache.block_size
        self.structured_outputs: StructuredOutputs | None = None  # set by the engine on the first constrained request

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[int], sample_seqs: list[Sequence]) -> StepOutput:
        """Run one step. sample_rows[j] is the batch index whose logits sample_seqs[j] samples from: its last
        token's, or, for a sequence with drafts, all of its tokens' (the drafts are verified)."""
        self.kv_cache.copy_blocks(batch.blocks_to_copy)
        if self.drafter is not None:
            self.drafter.copy_blocks(batch.blocks_to_copy)
            lookahead = [s for s in batch.seqs if s.num_lookahead_tokens]
            if lookahead:
                self.drafter.propose(lookahead)
        # Grammar masks are computed in a thread while the model runs.
        constrained = [j for j, s in enumerate(sample_seqs) if s.grammar is not None]
        masks = self._structured().start_masks([(grammar, sample_seqs[j].spec_token_ids) for j in constrained
                                                if (grammar := sample_seqs[j].grammar) is not None]
                                               ) if constrained else None
        input_ids, positions, layout = self._prepare(batch)
        if self.graphs is not None and self.graphs.can_run(layout):
            hidden = self.graphs.run(input_ids, positions, layout)
        else:
            hidden = self.model(input_ids, positions, self.attention, self.kv_cache,
                                self.model.prepare_attention(self.attention, layout))
        if self.drafter is not None:
            self.drafter.mirror(input_ids, positions, layout)
        prompt_logprobs = self._prompt_logprobs(hidden, layout, batch)
        if not sample_seqs:
            return StepOutput([], [], prompt_logprobs)
        spec = [j for j, s in enumerate(sample_seqs) if s.spec_token_ids]
        if not spec:
            last_token = [layout.query_start[i] + layout.query_lens[i] - 1 for i in sample_rows]
            logits = self.model.compute_logits(hidden[torch.tensor(last_token, device=self.device)])
            if masks is not None:
                self._structured().apply_masks(logits, masks.result(), constrained)
            sampled = self.sampler(logits, sample_seqs)
            return StepOutput([[t] for t in sampled.token_ids], sampled.logprobs, prompt_logprobs)
        out = self._sample_with_drafts(hidden, layout, sample_rows, sample_seqs, spec, constrained, masks)
        out.prompt_logprobs = prompt_logprobs
        return out

    def _structured(self) -> StructuredOutputs:
        assert self.structured_outputs is not None, "a sequence has a grammar only once the engine built one"
        return self.structured_outputs

    def _prompt_logprobs(self, hidden: torch.Tensor, layout: BatchLayout,
                         batch: ScheduledBatch) -> list[tuple[Sequence, list[dict[int, float]]]]:
        """Logprobs of the prompt tokens that this step's prefill chunks predict (the logits at
        position p score prompt token p + 1), for requests that asked. Full-vocabulary logits exist
        for PROMPT_LOGPROBS_ROWS positions at a time; only the token's own logprob and the top-N
        leave the device."""
        out = []
        for i, seq in enumerate(batch.seqs):
            request = seq.request
            if not request.needs_prompt_logprobs or seq.index != 0:
                continue
            assert request.prompt_logprobs is not None and request.params.prompt_logprobs is not None
            start, num_prompt = seq.num_computed_tokens, seq.num_prompt_tokens
            # Targets already scored (before a preemption) are not scored again.
            first = max(start + 1, len(request.prompt_logprobs))
            last = min(start + layout.query_lens[i], num_prompt - 1)  # the last target, inclusive
            if first > last:
                continue
            row0 = layout.query_start[i] - start  # hidden row of position 0 of this sequence
            rows = torch.arange(row0 + first - 1, row0 + last, device=self.device)
            targets = torch.tensor(seq.token_ids[first : last + 1], device=self.device)
            out.append((seq, self._score(hidden, rows, targets, request.params.prompt_logprobs)))
        return out

    def _score(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
               top_n: int) -> list[dict[int, float]]:
        entries: list[dict[int, float]] = []
        for lo in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows[lo : lo + PROMPT_LOGPROBS_ROWS]])
                                         .float(), dim=-1)
            chunk_targets = targets[lo : lo + PROMPT_LOGPROBS_ROWS]
            chosen = logprobs.gather(1, chunk_targets[:, None])[:, 0].tolist()
            top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0], logprobs[:, :0].long())
            for token, lp, ids, vals in zip(chunk_targets.tolist(), chosen, top_ids.tolist(), top_vals.tolist()):
                entry = {token: lp}
                for t, v in zip(ids, vals):
                    entry.setdefault(t, v)
                entries.append(entry)
        return entries

    def _sample_with_drafts(self, hidden: torch.Tensor, layout: BatchLayout, sample_rows: list[int],
                            sample_seqs: list[Sequence], spec: list[int], constrained: list[int],
                            masks: Future[torch.Tensor] | None) -> StepOutput:
        spec_set = set(spec)
        plain = [j for j in range(len(sample_seqs)) if j not in spec_set]
        index = [layout.query_start[sample_rows[j]] + layout.query_lens[sample_rows[j]] - 1 for j in plain]
        first_row = {j: r for r, j in enumerate(plain)}  # sample_seqs[j]'s first logits row
        for j in spec:
            start = layout.query_start[sample_rows[j]]
            first_row[j] = len(index)
            index.extend(range(start, start + layout.query_lens[sample_rows[j]]))
        logits = self.model.compute_logits(hidden[torch.tensor(index, device=self.device)])
        if masks is not None:  # mask rows: 1 + drafts per constrained sequence, in order
            rows = [first_row[j] + k for j in constrained for k in range(1 + len(sample_seqs[j].spec_token_ids))]
            self._structured().apply_masks(logits, masks.result(), rows)
        token_ids: list[list[int]] = [[] for _ in sample_seqs]
        logprobs: list[dict[int, float] | None] = [None] * len(sample_seqs)
        if plain:
            out = self.sampler(logits[: len(plain)], [sample_seqs[j] for j in plain])
            for j, t, lp in zip(plain, out.token_ids, out.logprobs):
                token_ids[j], logprobs[j] = [t], lp
        verified = self.rejection_sampler(logits[len(plain) :], [sample_seqs[j] for j in spec])
        for j, tokens in zip(spec, verified):
            token_ids[j] = tokens
        return StepOutput(token_ids, logprobs)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
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
            if seq.spec_token_ids:
                ids.extend(seq.spec_token_ids)
        tables = [s.block_table for s in batch.seqs]
        table_tensor, slots = block_tables_to_slots(tables, seq_of_token, positions, self.block_size, self.device)
        layout = BatchLayout(
            query_start=query_start[:-1].tolist(),
            query_lens=batch.num_new_tokens,
            seq_lens=(starts + num_new).tolist(),
            block_tables=tables,
            block_table_tensor=table_tensor,
            slot_mapping=slots,
        )
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.from_numpy(positions).to(self.device), layout)
