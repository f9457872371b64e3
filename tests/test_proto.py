"""The committed gRPC stubs are what the .proto files generate, and the wire conversions round-trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.common.structured_outputs import StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_proto_files(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    generated = sorted(p.name for p in (tmp_path / "metroserve/rpc").iterdir())
    assert generated, "protoc wrote nothing"
    for name in generated:
        committed = ROOT / "proto/metroserve/rpc" / name
        assert committed.exists(), f"{name} is generated but not committed; run scripts/gen_proto.sh"
        assert committed.read_text() == (tmp_path / "metroserve/rpc" / name).read_text(), \
            f"{name} is stale; run scripts/gen_proto.sh"


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={7: 2.5}, seed=11, max_tokens=None,
                   min_tokens=2, ignore_eos=True, stop=["\n\n", "END"], stop_token_ids=[3],
                   include_stop_str_in_output=True, logprobs=4, skip_special_tokens=False),
    SamplingParams(max_tokens=0, prompt_logprobs=0, allowed_token_ids=[1, 5], bad_words_token_ids=[[4], [7, 8]]),
    SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "object"}', strict=False)),
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes", "no"), any_whitespace=True)),
    SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
])
def test_sampling_params_round_trip(params):
    from metroserve.rpc.convert import params_from_proto, params_to_dict, params_to_proto

    back = params_from_proto(params_to_proto(params))
    assert params_to_dict(back) == params_to_dict(params)
    assert params_to_dict(SamplingParams(**params_to_dict(params))) == params_to_dict(params)


def test_limits_round_trip():
    from metroserve.rpc.convert import limits_from_proto, limits_to_proto

    limits = RequestLimits(vocab_size=512, max_model_len=2048, max_num_seqs=8, block_size=16, num_blocks=99)
    assert limits_from_proto(limits_to_proto(limits)) == limits


def test_out_of_range_params_from_the_wire_raise_value_error():
    from metroserve.rpc import generation_pb2
    from metroserve.rpc.convert import params_from_proto

    with pytest.raises(ValueError, match="top_p"):
        params_from_proto(generation_pb2.SamplingParams(top_p=1.5))
