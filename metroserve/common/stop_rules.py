"""When a sequence ends: the stop rules, one implementation for the engine and the gateway.

For each new output token, in this order (vLLM's semantics):
1. a stop token id, from ``min_tokens`` on: "stop"; its text is output only with
   ``include_stop_str_in_output``;
2. an EOS token, from ``min_tokens`` on, unless ``ignore_eos``: "stop"; its text is not output;
3. a stop string completed by the token's text, from ``min_tokens`` on: "stop" (the detokenizer
   cuts the text at the match);
4. ``max_tokens`` output tokens, or the context length: "length".

The engine applies all four. The gateway, which detokenizes for workers that run without text,
applies the same function to the tokens a worker streams: the worker's own finish (a stop token,
EOS or length) arrives with the last token, so the gateway passes that token as the only EOS id
and no context length, and the rules land on the same reason and the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from metroserve.common.detokenizer import IncrementalDetokenizer
from metroserve.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


def append_token(token: int, num_output_tokens: int, params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None, eos_token_ids: tuple[int, ...] | list[int] = (),
                 num_tokens: int = 0, max_model_len: int | None = None) -> Finish | None:
    """Apply the rules to a token just appended (it is output token number ``num_output_tokens``);
    adds its text to ``detokenizer`` when it has one. Returns how the sequence ends, or None."""
    may_stop = num_output_tokens >= params.min_tokens
    if may_stop and token in (params.stop_token_ids or ()):
        if params.include_stop_str_in_output and detokenizer is not None:
            detokenizer.add_token(token, check_stop=False)
        return Finish("stop", token)
    if may_stop and not params.ignore_eos and token in eos_token_ids:
        return Finish("stop")
    if detokenizer is not None and (hit := detokenizer.add_token(token, check_stop=may_stop)) is not None:
        return Finish("stop", hit)
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return Finish("length")
    if max_model_len is not None and num_tokens >= max_model_len:
        return Finish("length")
    return None
