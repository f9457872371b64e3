"""NgramProposer: prompt-lookup drafts, no extra model.

If the sequence's last n tokens occurred earlier in its prompt or output, the tokens that followed
that occurrence are proposed as the continuation. Editing, quoting and repeating a given text
make such matches common; the target model verifies every draft token, so a wrong guess costs
only the verification work.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from metroserve.worker.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """Set seq.spec_token_ids (at most num_tokens[i] ids, possibly none) for each sequence."""
        for seq, k in zip(seqs, num_tokens):
            seq.spec_token_ids = self.lookup(seq.token_ids, k)
            seq.num_lookahead_tokens = len(seq.spec_token_ids)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows over tokens[:-1] start before the suffix itself and leave a token after them.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
