"""Wire messages <-> engine dataclasses, in one place for the gateway, the scheduler and the worker."""

from __future__ import annotations

from dataclasses import fields

from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.common.structured_outputs import StructuredOutputsParams
from metroserve.rpc import cluster_pb2, generation_pb2

_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "min_tokens", "logprobs", "skip_special_tokens", "speculative",
             "prompt_logprobs")


def params_to_proto(p: SamplingParams) -> generation_pb2.SamplingParams:
    m = generation_pb2.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias, min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos, stop=list(p.stop_strings), stop_token_ids=p.stop_token_ids,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        speculative=p.speculative, allowed_token_ids=p.allowed_token_ids or [],
        bad_words=[generation_pb2.TokenIds(ids=w) for w in p.bad_words_token_ids or ()])
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.structured_outputs is not None:
        m.structured_outputs.CopyFrom(structured_outputs_to_proto(p.structured_outputs))
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.max_tokens is None:
        m.max_tokens_unlimited = True
    else:
        m.max_tokens = p.max_tokens
    return m


def params_from_proto(m: generation_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (via SamplingParams' checks) for out-of-range values."""
    kwargs = {name: getattr(m, name) for name in _OPTIONAL if m.HasField(name)}
    if m.max_tokens_unlimited:
        kwargs["max_tokens"] = None
    elif m.HasField("max_tokens"):
        kwargs["max_tokens"] = m.max_tokens
    return SamplingParams(**kwargs, logit_bias=dict(m.logit_bias), ignore_eos=m.ignore_eos,
                          stop=list(m.stop) or None, stop_token_ids=list(m.stop_token_ids),
                          include_stop_str_in_output=m.include_stop_str_in_output,
                          allowed_token_ids=list(m.allowed_token_ids) or None,
                          bad_words_token_ids=[list(w.ids) for w in m.bad_words],
                          structured_outputs=structured_outputs_from_proto(m.structured_outputs)
                          if m.HasField("structured_outputs") else None)


def structured_outputs_to_proto(s: StructuredOutputsParams) -> generation_pb2.StructuredOutputs:
    m = generation_pb2.StructuredOutputs(any_whitespace=s.any_whitespace, not_strict=not s.strict)
    if s.choice is not None:
        m.choice.options.extend(s.choice)
    else:
        setattr(m, s.kind, getattr(s, s.kind))
    return m


def structured_outputs_from_proto(m: generation_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Raises StructuredOutputsError (a ValueError) for a message without a kind."""
    kind = m.WhichOneof("kind")
    kinds: dict[str, object] = {}
    if kind is not None:
        kinds[kind] = tuple(m.choice.options) if kind == "choice" else getattr(m, kind)
    return StructuredOutputsParams(**kinds, any_whitespace=m.any_whitespace, strict=not m.not_strict)  # type: ignore[arg-type]


def params_to_dict(p: SamplingParams) -> dict:
    """JSON-ready, for the request-state store."""
    return {f.name: getattr(p, f.name) for f in fields(p) if f.init}


def limits_to_proto(limits: RequestLimits) -> cluster_pb2.RequestLimits:
    return cluster_pb2.RequestLimits(**{f.name: getattr(limits, f.name) for f in fields(limits)})


def limits_from_proto(m: cluster_pb2.RequestLimits) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(m, f.name) for f in fields(RequestLimits)})


def logprobs_to_proto(chosen: int, logprobs: dict[int, float]) -> generation_pb2.TokenLogprobs:
    """The chosen token first, then the alternatives by rank."""
    others = sorted(((t, lp) for t, lp in logprobs.items() if t != chosen), key=lambda x: -x[1])
    return generation_pb2.TokenLogprobs(token_ids=[chosen] + [t for t, _ in others],
                                        logprobs=[logprobs[chosen]] + [lp for _, lp in others])
