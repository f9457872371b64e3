"""Structured outputs on the worker: StructuredOutputsParams -> xgrammar grammars, matchers, token masks.

xgrammar (a maintained grammar engine used by vLLM, SGLang and TensorRT-LLM) compiles JSON
schemas, regexes, EBNF grammars and choices against the tokenizer's vocabulary, and a
GrammarMatcher per sequence yields the set of tokens allowed next as a packed bitmask. The engine
keeps one matcher per constrained sequence (Sequence.grammar), advances it with every accepted
token, and ends the sequence when the grammar is complete. For a sequence with speculative drafts
the masks of all verified positions are computed by walking the matcher through the drafts and
rolling it back: a draft the grammar forbids gets probability zero in the verification and is
never accepted. A preempted sequence keeps its matcher (its tokens do not change); a migrated one
gets a fresh matcher that replays the output it resumes with.

Thread-safety: compile() runs where a request is added (the worker's event loop, so a bad grammar
is refused before it is queued) and where n > 1 forks it (the engine thread); xgrammar's compiler
and its cache are thread-safe.
Costs: a compile is milliseconds for typical schemas and cached by content; a mask is
microseconds per sequence (the C++ matcher releases the GIL, so it overlaps the forward), and its
unpacking to a boolean mask runs there too; the engine thread only does one masked_fill.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from metroserve.common.structured_outputs import StructuredOutputsParams

# xgrammar's messages start with "[time] source/file.cc:line: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


class GrammarError(ValueError):
    """The grammar engine rejected a request's schema, regex or grammar."""

    param = "structured_outputs"  # the request field at fault, for the client's error


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Raises GrammarError naming what the grammar engine rejected."""
        try:
            if spec.json is not None:
                return self.compiler.compile_json_schema(spec.json, any_whitespace=spec.any_whitespace,
                                                         strict_mode=spec.strict)
            if spec.json_object:
                return self.compiler.compile_builtin_json_grammar()
            if spec.regex is not None:
                return self.compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                # JSON string literals are valid EBNF string literals (same escapes).
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            assert spec.grammar is not None, "StructuredOutputsParams holds exactly one kind"
            return self.compiler.compile_grammar(spec.grammar)
        except RuntimeError as e:  # xgrammar's parse and conversion errors
            detail = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0])
            raise GrammarError(f"the {spec.kind} constraint was rejected by the grammar engine: {detail}") from None

    def matcher(self, spec: StructuredOutputsParams, resume_token_ids: list[int]) -> xgr.GrammarMatcher:
        """A fresh matcher that has accepted resume_token_ids (a migrated sequence's output so far)."""
        matcher = xgr.GrammarMatcher(self.compile(spec))
        for token in resume_token_ids:
            accepted = matcher.accept_token(token)
            assert accepted, "resumed output was generated under the same grammar"
        return matcher

    def start_masks(self, rows: list[tuple[xgr.GrammarMatcher, list[int]]]) -> Future[torch.Tensor]:
        """Begin computing, in a worker thread, the mask rows for (matcher, drafts) pairs: 1 + len(drafts)
        rows each (the mask before each draft and after the last). Result: bool [rows, vocab], True
        where a token is forbidden."""
        return self._pool.submit(self._masks, rows)

    @staticmethod
    def apply_masks(logits: torch.Tensor, forbidden: torch.Tensor, rows: list[int]) -> None:
        """logits[rows[i]] -> -inf where forbidden[i] (in place). A masked_fill: xgrammar's own CPU
        kernel costs about 4 ns per forbidden logit, 6 ms a step at batch 32 (benchmarks/README.md)."""
        forbidden = forbidden.to(logits.device, non_blocking=True)
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(forbidden, float("-inf"))
            return
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

    def _masks(self, rows: list[tuple[xgr.GrammarMatcher, list[int]]]) -> torch.Tensor:
        total = sum(1 + len(drafts) for _, drafts in rows)
        bitmask = xgr.allocate_token_bitmask(total, self.vocab_size)
        row = 0
        for matcher, drafts in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
            walked = 0  # drafts the matcher accepted, in order
            for i, draft in enumerate(drafts, start=1):
                if walked == i - 1 and not matcher.is_terminated() and matcher.accept_token(draft):
                    walked += 1
                    if not matcher.is_terminated():
                        matcher.fill_next_token_bitmask(bitmask, row + i)
                        continue
                # Past a forbidden draft (rejected at the row before) or the grammar's end the rows
                # are never used to choose a token; a copy keeps them valid distributions.
                bitmask[row + i] = bitmask[row + i - 1]
            if walked:
                matcher.rollback(walked)
            row += 1 + len(drafts)
        return self._forbidden(bitmask)

    def _forbidden(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Packed allowed bits (int32 [rows, ceil(vocab / 32)], bit j of word w = token 32 w + j) ->
        bool [rows, vocab], True where forbidden; here, in the mask thread, off the step's path."""
        bits = (bitmask.view(torch.uint8)[:, :, None] >> _BIT_SHIFTS) & 1  # little-endian bytes
        return (bits == 0).reshape(bitmask.shape[0], -1)[:, : self.vocab_size]
