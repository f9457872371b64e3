"""Hugging Face transformers as the reference for greedy decoding."""

from __future__ import annotations

from pathlib import Path

import torch

NEAR_TIE = 1e-3  # logprob gap under which two tokens are a floating-point tie


class HFReference:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else eos or [])
        # generate() fills an unset eos_token_id from here: unset, greedy() alone decides.
        self.model.generation_config.eos_token_id = None
        self._cache: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
        key = (tuple(prompt), max_new_tokens, stop_at_eos)
        if key not in self._cache:
            from transformers import GenerationConfig

            ids = torch.tensor([prompt])
            config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                                      eos_token_id=sorted(self.eos) if stop_at_eos else None)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]

    @torch.inference_mode()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """Next-token logprobs after the given tokens."""
        logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1)

    def near_tie(self, tokens: list[int], a: int, b: int) -> tuple[float, float]:
        """The reference's logprob gap between tokens a and b after `tokens`, and the gap under which
        that is a floating-point tie at the reference's precision."""
        lp = self.logprobs(tokens)
        return abs(lp[a].item() - lp[b].item()), NEAR_TIE

    def assert_matches(self, prompt: list[int], ours: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> None:
        """Our greedy ids equal the reference's, except past a divergence the reference shows to be a near-tie."""
        ref = self.greedy(prompt, max_new_tokens, stop_at_eos)
        for i, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                gap, tie = self.near_tie(prompt + ref[:i], a, b)
                assert gap < tie, (
                    f"greedy divergence at output token {i}: ours {a} vs reference {b}, logprob gap {gap:.2e} "
                    f"is not a near-tie (< {tie:.1e})\nours {ours}\nref  {ref}")
                return
        assert len(ours) == len(ref), (f"length differs: ours {len(ours)} vs reference {len(ref)}\n"
                                       f"ours {ours}\nref  {ref}")
