"""Write a transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does: a test fixture.

Metadata, tensor names and tensor layout follow llama.cpp's converter for each architecture (the
keys it writes, and the ones it leaves out), including its conversion-time changes: the rotary
permutation of Llama's Q/K rows and +1 on Gemma's RMSNorm weights. The tokenizer is written as a
byte-level (`gpt2`) vocabulary with merges, special-token ids and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast


def write_gguf(
    path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, arch: str, *, name: str = "tiny",
    f16: bool = False,
) -> Path:
    """`model` as a GGUF file of llama.cpp architecture `arch` named `name` (general.name); `f16` stores
    matrices as F16 and the rest as F32, as llama.cpp's `--outtype f16` does."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _write_hparams(writer, model.config, arch)
    _write_vocab(writer, tokenizer, model.config.vocab_size)
    for name, weights in _gguf_tensors(model, arch):
        # llama.cpp keeps vectors (norms, biases) in F32 whatever the file type.
        writer.add_tensor(name, weights.astype(np.float16 if f16 and weights.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    if arch == "phi3":
        rotary_dims = int(head_dim * rope["partial_rotary_factor"])
        writer.add_rope_dimension_count(rotary_dims)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    elif arch != "gemma2":  # Gemma 2's converter writes no rope base (llama.cpp's default applies)
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if rope["rope_type"] in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    # The generic converter writes key/value lengths only where config.json has head_dim.
    if arch in ("llama", "qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])


def _gguf_tensors(model: PreTrainedModel, arch: str) -> list[tuple[str, np.ndarray]]:
    config = model.config
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    tensors = []
    for hf_name, parameter in model.named_parameters():  # a tied lm_head is not listed
        weights = parameter.detach().float()
        if arch == "llama" and ".q_proj." in hf_name:
            weights = _permute(weights, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            weights = _permute(weights, config.num_key_value_heads)
        elif arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            weights = weights + 1
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        tensors.append((gguf_name, weights.numpy()))
    rope = config.rope_parameters
    if rope.get("rope_type") == "longrope":  # Phi-3: the LongRoPE factors become tensors
        tensors.append(("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)))
        tensors.append(("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)))
    return tensors


def _permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: interleave the two rotary halves of each head's rows."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def _write_vocab(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
    """llama.cpp's _set_vocab_gpt2: every id up to vocab_size, specials as CONTROL, unused ids padded."""
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    tokens = [by_id.get(index, f"[PAD{index}]") for index in range(vocab_size)]
    types = [
        gguf.TokenType.UNUSED if index not in by_id else
        gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL
        for index in range(vocab_size)
    ]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
