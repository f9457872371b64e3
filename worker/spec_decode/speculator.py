"""Speculator: decides which sequences draft each step, and counts what verification accepted.

Before the batcher builds a step, ``plan`` gives each eligible decoding sequence a lookahead:
n-gram drafts are looked up right there; a draft model only reserves k positions, and the model
runner fills them after the batcher has allocated their KV slots. The batcher then schedules
1 + lookahead tokens for such a sequence, so speculating and plain sequences share one step.

A sequence drafts only when that cannot change what it would produce:
- it asked for no repetition / presence / frequency penalty and no bad words (they depend on
  every earlier token, drafts included), no logprobs, and no seed (a seeded request promises the same text alone and in
  a busy batch, and speculation, which switches on and off with the batch size, draws differently);
- its min_tokens are done; it did not switch speculation off (SamplingParams.speculative=False).
"""

from __future__ import annotations

from dataclasses import dataclass

from metroserve.worker.sequence import Sequence
from metroserve.worker.spec_decode.config import SpeculativeConfig
from metroserve.worker.spec_decode.ngram_proposer import NgramProposer


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification rounds of a sequence with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating sequence gains per target forward: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.stats = SpecDecodeStats()
        self._planned: list[Sequence] = []

    def plan(self, running: list[Sequence]) -> None:
        """Set this step's lookahead (and n-gram drafts) on the running sequences."""
        for seq in self._planned:
            seq.clear_spec()
        self._planned = []
        if len(running) > self.config.disable_by_batch_size:
            return
        seqs, ks = [], []
        for seq in running:
            k = self._lookahead(seq)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        if self.ngram is not None:
            self.ngram.propose(seqs, ks)
        else:
            for seq, k in zip(seqs, ks):
                seq.num_lookahead_tokens = k
        self._planned = seqs

    def _lookahead(self, seq: Sequence) -> int:
        if seq.is_prefilling:
            return 0  # the prompt (or a preempted sequence's recompute) comes first
        if seq.spec_pause > 0:
            seq.spec_pause -= 1
            return 0
        p = seq.request.params
        if (not p.speculative or p.needs_penalties or p.logprobs is not None or p.seed is not None
                or p.bad_words_token_ids or seq.num_output_tokens < p.min_tokens):
            return 0
        k = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)  # the last token is always the target's own
        return max(k, 0)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count one verification; a sequence whose drafts keep failing pauses drafting."""
        if num_drafted == 0:
            return
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        # Exponential average over the last few rounds, starting neutral (Sequence: 0.5), so about
        # three rounds with nothing accepted pause a sequence.
        seq.spec_acceptance = 0.7 * seq.spec_acceptance + 0.3 * num_accepted / num_drafted
        if seq.spec_acceptance < self.config.min_acceptance_rate:
            seq.spec_pause = self.config.pause_steps
            seq.spec_acceptance = 0.5
