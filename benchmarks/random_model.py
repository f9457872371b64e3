"""Random-weight model directories built in code: no hub, no weights shipped.

"tiny" is the test model (2 layers, GQA 4 query heads over 2 KV heads, wide weights so greedy
argmaxes are not floating-point ties). The real shapes (SmolLM2-135M, the default model's
architecture, and Llama-3.2-1B) are for speed measurements on a GPU machine that has no copy of
the weights: step time depends on shapes, not on weight values. All share a 512-token byte-level
BPE with a ChatML template, trained here on a few stdlib docstrings; ids beyond it decode to
nothing, so a 49k-vocabulary model still runs end to end. write_random_family builds the same
kind of tiny model for each other family the engine serves, from transformers' own config class,
with that family's switches turned on (biases, q/k norms, sliding windows shorter than the test
prompts, partial rotary, soft-capping, a query scale).
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    # Llama-3.2-1B without its long-context RoPE scaling (irrelevant to speed), capped at 8k positions.
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=True),
}


def _training_text() -> list[str]:
    return [inspect.getdoc(m) or "" for m in (collections, json, textwrap, inspect, os, sys, torch.nn.Module)]


def write_tokenizer(path: Path):
    """The 512-token BPE with <|endoftext|> (pad), <|im_start|> (bos) and <|im_end|> (eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def write_random_llama(path: Path, shape: str = "tiny", seed: int = 0, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> Path:
    """An HF-format directory (config, safetensors, tokenizer) of the named shape.

    The tiny model gets wide weights (std 0.25, embeddings 1.0): at the usual init scale a random
    model's logits are near-uniform and every greedy argmax is a floating-point tie. The real
    shapes keep transformers' init, which is all a speed measurement needs.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path)
    cfg = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy reads as an unbound function.
        model = LlamaForCausalLM(cfg).to(dtype)  # type: ignore[arg-type]
    if shape == "tiny":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.25 if "embed" not in name else 1.0)
    model.to("cpu").save_pretrained(path)
    return path


# family -> (transformers config class, model class, what the tiny shape adds). Windows are shorter
# than the tests' longer prompts and of several sizes relative to a 16-token block.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, attention_bias=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=40, partial_rotary_factor=0.5)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, num_hidden_layers=4, sliding_window=16,
                                                          query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                                                          final_logit_softcapping=15.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, num_hidden_layers=4, sliding_window=12,
                                                              sliding_window_pattern=2, query_pre_attn_scalar=16,
                                                              rope_local_base_freq=100.0)),
}


def write_random_family(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny random model of `family` (a key of FAMILIES) with wide weights, as write_random_llama's
    tiny one; norm weights get noise too, so a family's norm variant (Gemma's 1 + w) is exercised."""
    import transformers

    config_class, model_class, extra = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path)
    shape = {k: v for k, v in SHAPES["tiny"].items() if k not in extra}
    cfg = getattr(transformers, config_class)(
        **shape, **extra, rms_norm_eps=1e-5, bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.25 if "embed" not in name else 1.0)
    model.save_pretrained(path)
    return path
