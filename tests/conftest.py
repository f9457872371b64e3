"""Shared fixtures: a tiny random-weight Llama (GQA) with a small trained tokenizer, the SmolLM2
checkpoint, and Hugging Face reference generation to compare against."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. triton.jit reads this
# when a kernel is defined, so it is set before any test imports worker.triton_attention.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.reference import HFReference  # noqa: E402

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _training_text() -> list[str]:
    import collections, json as _json, textwrap  # noqa: E401 - a few stdlib modules with long docstrings

    return [inspect.getdoc(m) or "" for m in (collections, _json, textwrap, inspect, os, sys, torch.nn.Module)]


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with GQA (4 query heads over 2 KV heads) and a 512-token byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(path)

    eos = fast.convert_tokens_to_ids("<|im_end|>")
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=fast.convert_tokens_to_ids("<|im_start|>"), eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Wide weights so logits are well separated: random models at the usual init scale produce
    # near-uniform logits where every argmax is a floating-point tie.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.25 if "embed" not in name else 1.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from worker.model_files import ModelLoadError, resolve_model_dir

    try:
        return resolve_model_dir(None)
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_ref(tiny_model_dir) -> HFReference:
    return HFReference(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_ref(smollm2_dir) -> HFReference:
    return HFReference(smollm2_dir)


def assert_all_blocks_free(llm_or_engine) -> None:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    assert all(c == 0 for c in bm.ref_cnt)
