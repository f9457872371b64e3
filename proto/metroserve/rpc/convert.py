"""Wire messages <-> engine dataclasses, in one place for the gateway, the scheduler and the worker."""

from __future__ import annotations

from dataclasses import fields

from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.rpc import cluster_pb2, generation_pb2

_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "min_tokens", "logprobs", "skip_special_tokens", "speculative")


def params_to_proto(p: SamplingParams) -> generation_pb2.SamplingParams:
    m = generation_pb2.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias, min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos, stop=list(p.stop_strings), stop_token_ids=p.stop_token_ids,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        speculative=p.speculative)
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
                          include_stop_str_in_output=m.include_stop_str_in_output)


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
