"""RejectionSampler: verifies draft tokens against the target model, exactly.

For a sequence with drafts d_1..d_k the target computed logits at k+1 positions in one forward.
Greedy rows accept drafts while each equals the target's argmax, then add the target's own token.
Sampled rows use speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept
d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
normalize(max(p_j - q_j, 0)); if every draft is accepted draw a bonus token from p_{k+1}. Each
output token is then distributed exactly as the target's p, whatever the draft's q. A proposer
without a distribution (n-gram lookup) is a point mass: q_j = one-hot(d_j).
"""

from __future__ import annotations

import torch

from metroserve.worker.sampler import Sampler
from metroserve.worker.sequence import Sequence


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification round for R rows of up to K drafts.

    target_probs [R, K+1, V]; draft_tokens [R, K] (entries past num_drafts[r] are ignored);
    draft_probs [R, K, V] or None for point-mass drafts. Returns (num_accepted [R], next_token [R]):
    row r emits draft_tokens[r, :num_accepted[r]] followed by next_token[r].
    """
    num_rows, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    drafts = draft_tokens.clamp(min=0)
    p_draft = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
    uniform = torch.rand(num_rows, k, generator=generator, device=device, dtype=target_probs.dtype)
    valid = torch.arange(k, device=device)[None, :] < num_drafts[:, None]
    # u < p/q, written without the division; q(d) > 0 because d was drawn from q.
    accepted = (uniform * q_draft < p_draft) & valid
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)

    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        q_next = torch.zeros_like(p_next)
    elif draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(1, drafts[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    residual = (p_next - q_next).clamp(min=0.0)
    final = torch.where(rejected[:, None], residual, p_next)
    total = final.sum(dim=1, keepdim=True)
    # A residual of zero mass needs p == q at the draft, which is always accepted; guard rounding.
    final = torch.where(total > 0, final / total.clamp(min=torch.finfo(final.dtype).tiny), p_next)
    next_token = torch.multinomial(final, 1, generator=generator)[:, 0]
    return num_accepted, next_token


class RejectionSampler:
    """Turns the target's logits at each speculating sequence's k+1 positions into accepted tokens."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
        """logits: seqs[i]'s 1 + len(spec_token_ids) rows, one sequence after another."""
        lens = [1 + len(s.spec_token_ids) for s in seqs]
        # Speculating sequences have no penalties, bad words or min_tokens pending (see Speculator):
        # of the logits processing only logit_bias and allowed_token_ids can apply, the same at
        # every position.
        if any(s.request.params.logit_bias or s.request.params.allowed_token_ids for s in seqs):
            row_seqs = [s for s, n in zip(seqs, lens) for _ in range(n)]
            logits = self.sampler.process_logits(logits, row_seqs)
        out: list[list[int]] = [[] for _ in seqs]
        greedy = [i for i, s in enumerate(seqs) if s.request.params.greedy]
        sampled = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        if greedy:
            self._verify_greedy(logits, seqs, greedy, starts, out)
        if sampled:
            self._verify_sampled(logits, seqs, sampled, starts, out)
        return out

    @staticmethod
    def _verify_greedy(logits, seqs, rows, starts, out) -> None:
        index = [j for i in rows for j in range(starts[i], starts[i + 1])]
        targets = logits[index].argmax(dim=-1).tolist()
        pos = 0
        for i in rows:
            drafts = seqs[i].spec_token_ids
            n = len(drafts) + 1
            target = targets[pos : pos + n]
            pos += n
            a = 0
            while a < len(drafts) and drafts[a] == target[a]:
                a += 1
            out[i] = target[: a + 1]

    def _verify_sampled(self, logits, seqs, rows, starts, out) -> None:
        device = logits.device
        k = max(len(seqs[i].spec_token_ids) for i in rows)
        vocab = logits.shape[1]
        index = torch.tensor([[min(starts[i] + j, starts[i + 1] - 1) for j in range(k + 1)] for i in rows],
                             device=device)
        params = [seqs[i].request.params for i in rows for _ in range(k + 1)]
        target_probs = Sampler.probs(logits[index.flatten()], params).view(len(rows), k + 1, vocab)
        drafts = torch.tensor([seqs[i].spec_token_ids + [-1] * (k - len(seqs[i].spec_token_ids)) for i in rows],
                              device=device)
        num_drafts = torch.tensor([len(seqs[i].spec_token_ids) for i in rows], device=device)
        draft_probs = None
        if seqs[rows[0]].draft_probs is not None:
            draft_probs = torch.zeros(len(rows), k, vocab, device=device, dtype=target_probs.dtype)
            for r, i in enumerate(rows):
                q = seqs[i].draft_probs
                draft_probs[r, : q.shape[0]] = q
        num_accepted, next_token = rejection_sample(target_probs, drafts, num_drafts, draft_probs,
                                                    self.sampler.generator)
        for r, (a, t) in enumerate(zip(num_accepted.tolist(), next_token.tolist())):
            i = rows[r]
            out[i] = seqs[i].spec_token_ids[:a] + [t]
