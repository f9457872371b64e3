"""Convert a GGUF file (llama.cpp's format) into a Hugging Face-format model directory.

One table entry per architecture (`_FAMILIES`) says which transformers class the file becomes and
which of llama.cpp's conversion-time changes to undo (the Q/K rotary permutation of Llama, the +1
on Gemma's norm weights); tensor names map through the gguf package's own table. Every tensor is
dequantized to float32. The result is what transformers itself would save for the model, so the
engine loads it like any other checkpoint. worker/model_files.py caches the output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from metroserve.worker.model_files import ModelLoadError
from metroserve.worker.quantization import QUANTIZED_FILE

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

# The GGML types whose matrices are kept as raw blocks too (in quantization.QUANTIZED_FILE).
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")

def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face model directory (float32 weights) for a GGUF file of a supported architecture."""
    header = _open_gguf(gguf_path)
    family = _family(header)
    tensors = {tensor.name: tensor for tensor in header.reader.tensors}
    config = _hf_config(header, family, tensors)
    weights = _hf_tensors(header, family, config)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    quantized, types = _quantized_tensors(header, family, config)
    if quantized:
        save_file(quantized, str(out_dir / QUANTIZED_FILE), metadata=types)
    _write_json(out_dir / "config.json", config)
    token_ids: dict[str, Any] = {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}
    _write_json(out_dir / "generation_config.json", token_ids)
    _write_tokenizer(header.reader, gguf_path, out_dir)


@dataclass(frozen=True)
class _Header:
    """An open GGUF file with its architecture; `get`/`need` read metadata under that architecture."""

    reader: GGUFReader
    path: Path
    arch: str

    def get(self, key: str) -> Any:
        """The value of `{arch}.{key}`, or None when absent."""
        return _metadata(self.reader, f"{self.arch}.{key}")

    def need(self, key: str) -> Any:
        return _required(self.reader, f"{self.arch}.{key}", self.path)


# config.json fields of one family beyond the shared ones, from the header, the tensors and the shared fields.
_FieldsFn = Callable[[_Header, "dict[str, ReaderTensor]", "dict[str, Any]"], "dict[str, Any]"]


@dataclass(frozen=True)
class _Family:
    """The transformers class a GGUF architecture becomes, and what llama.cpp's converter changed on the way."""

    hf_class: str
    model_type: str
    fields: _FieldsFn
    # llama.cpp interleaves the two rotary halves of each Q/K head's rows (its LlamaModel.permute).
    rope_permuted: bool = False
    # llama.cpp stores Gemma's RMSNorm weights plus 1, since Gemma scales by (1 + weight).
    norm_offset: float = 0.0
    # Tensors that hold config values rather than weights.
    config_tensors: tuple[str, ...] = ()


def _open_gguf(path: Path) -> _Header:
    # gguf is imported only for a conversion: an already-converted model (or a GPU machine
    # serving an HF directory) does not need the package.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader reports damage as ValueError, IndexError, struct.error, ...
        raise ModelLoadError(f"{path}: not a valid GGUF file, or truncated ({type(exc).__name__}: {exc})") from exc
    architecture = _metadata(reader, "general.architecture")
    if architecture not in _FAMILIES:
        supported = ", ".join(repr(name) for name in _FAMILIES)
        raise ModelLoadError(f"{path}: GGUF architecture is {architecture!r}; supported are {supported}")
    return _Header(reader, path, architecture)


def _family(header: _Header) -> _Family:
    # llama.cpp writes Mistral models as 'llama'; like transformers' GGUF loader, tell them apart by name.
    name = str(_metadata(header.reader, "general.name") or "")
    if header.arch == "llama" and "mistral" in name.lower():
        return _MISTRAL
    return _FAMILIES[header.arch]


def _metadata(reader: GGUFReader, key: str) -> Any:
    """A scalar or string metadata value, or None when absent (arrays are not needed here)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    if field.types[0] == GGUFValueType.FLOAT32:
        return _shortest(value[0])
    return value[0].item()


def _shortest(value: np.float32) -> float:
    """The shortest decimal that rounds to the stored float32, as config.json had it (1e-06, not 9.99...e-07)."""
    return float(str(value))


def _required(reader: GGUFReader, key: str, path: Path) -> Any:
    value = _metadata(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key}")
    return value


def _hf_config(header: _Header, family: _Family, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """config.json for `family` in the transformers 5 format (rope_parameters)."""
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{header.path}: GGUF has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{header.path}: Llama 3 style rope frequency factors (rope_freqs) are not supported")

    hidden_size = int(header.need("embedding_length"))
    num_heads = int(header.need("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(header.need("feed_forward_length")),
        "num_hidden_layers": int(header.need("block_count")),
        "num_attention_heads": num_heads,
        # llama.cpp omits head_count_kv for models without grouped-query attention.
        "num_key_value_heads": int(header.get("attention.head_count_kv") or num_heads),
        "head_dim": int(header.get("attention.key_length") or hidden_size // num_heads),
        "rms_norm_eps": float(header.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(header.need("context_length")),
        # From the embedding matrix itself (GGUF shape order is (hidden, vocab)), so config and
        # weights cannot disagree.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    config.update(family.fields(header, tensors, config))
    for token in ("bos", "eos", "padding"):
        token_id = _metadata(header.reader, f"tokenizer.ggml.{token}_token_id")
        if token_id is not None:
            config[f"{'pad' if token == 'padding' else token}_token_id"] = int(token_id)
    return config


def _rope_parameters(header: _Header, default_theta: float) -> dict[str, Any]:
    """transformers' rope_parameters for the rope scaling llama.cpp writes: none, linear or yarn."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(header.get("rope.freq_base") or default_theta)}
    scaling = header.get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = float(header.need("rope.scaling.factor"))
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{header.path}: unsupported rope scaling type {scaling!r}")
    if scaling == "yarn":
        rope["original_max_position_embeddings"] = int(header.need("rope.scaling.original_context_length"))
        for gguf_key, hf_key in (("attn_factor", "attention_factor"), ("beta_fast", "beta_fast"),
                                 ("beta_slow", "beta_slow")):
            value = header.get(f"rope.scaling.yarn_{gguf_key}")
            if value is not None:
                rope[hf_key] = float(value)
    return rope


def _layer_types(num_layers: int, sliding_window: int | None, period: int) -> list[str]:
    """llama.cpp's fixed pattern: the last layer of every `period` sees everything, the others slide."""
    return [
        "sliding_attention" if sliding_window and (layer + 1) % period else "full_attention"
        for layer in range(num_layers)
    ]


def _llama_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": "silu",
        "rope_parameters": _rope_parameters(header, 10000.0),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


def _mistral_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    # Written even when None: MistralConfig's default window (4096) would otherwise apply.
    return {
        "hidden_act": "silu",
        "rope_parameters": _rope_parameters(header, 10000.0),
        "sliding_window": header.get("attention.sliding_window") or None,
    }


def _qwen2_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    # A Qwen GGUF carries no sliding window: llama.cpp attends over the whole context, and so does this config.
    return {
        "hidden_act": "silu",
        "rope_parameters": _rope_parameters(header, 10000.0),
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _qwen3_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    return {**_qwen2_fields(header, tensors, config), "attention_bias": "blk.0.attn_q.bias" in tensors}


def _phi3_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    rotary_dims = int(header.get("rope.dimension_count") or config["head_dim"])
    original_context = int(header.get("rope.scaling.original_context_length") or config["max_position_embeddings"])
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(header.get("rope.freq_base") or 10000.0),
        "partial_rotary_factor": rotary_dims / config["head_dim"],
    }
    # Phi-3's long-context (LongRoPE) models: llama.cpp stores the per-frequency factors as tensors.
    if "rope_factors_long.weight" in tensors:
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = original_context
        for kind in ("long", "short"):
            factors = tensors.get(f"rope_factors_{kind}.weight")
            if factors is None:
                raise ModelLoadError(f"{header.path}: GGUF has rope_factors_long but no rope_factors_short tensor")
            rope[f"{kind}_factor"] = [_shortest(factor) for factor in _dequantized(factors, header.path)]
    return {
        "hidden_act": "silu",
        "rope_parameters": rope,
        "original_max_position_embeddings": original_context,
        # llama.cpp writes 0 for "no sliding window" (Phi-4).
        "sliding_window": header.get("attention.sliding_window") or None,
    }


def _gemma_fields(header: _Header, config: dict[str, Any], layers_of_27b: int) -> dict[str, Any]:
    # GGUF has no query_pre_attn_scalar; llama.cpp scales attention by 1/sqrt(head_dim), except in the
    # 27B models (known by their layer count), whose checkpoints use hidden_size / heads.
    per_head = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": per_head if config["num_hidden_layers"] == layers_of_27b else config["head_dim"],
        "attn_logit_softcapping": header.get("attn_logit_softcapping"),
        "final_logit_softcapping": header.get("final_logit_softcapping"),
    }


def _gemma2_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    sliding_window = header.get("attention.sliding_window") or None
    return {
        **_gemma_fields(header, config, layers_of_27b=46),
        "rope_parameters": _rope_parameters(header, 10000.0),
        "sliding_window": sliding_window,
        "layer_types": _layer_types(config["num_hidden_layers"], sliding_window, period=2),
    }


def _gemma3_fields(header: _Header, tensors: dict[str, ReaderTensor], config: dict[str, Any]) -> dict[str, Any]:
    # Absent or 0: llama.cpp runs every layer with full attention.
    sliding_window = header.get("attention.sliding_window") or None
    # Sliding layers use their own rope base; older GGUFs lack the key and llama.cpp then assumes 10000.
    sliding_rope = {"rope_type": "default", "rope_theta": float(header.get("rope.freq_base_swa") or 10000.0)}
    return {
        **_gemma_fields(header, config, layers_of_27b=62),
        "rope_parameters": {
            "full_attention": _rope_parameters(header, 1_000_000.0),
            "sliding_attention": sliding_rope,
        },
        "sliding_window": sliding_window,
        "layer_types": _layer_types(config["num_hidden_layers"], sliding_window, period=6),
    }


_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", "llama", _llama_fields, rope_permuted=True),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2", _qwen2_fields),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3", _qwen3_fields),
    "phi3": _Family("Phi3ForCausalLM", "phi3", _phi3_fields, config_tensors=_ROPE_FACTOR_TENSORS),
    "gemma2": _Family("Gemma2ForCausalLM", "gemma2", _gemma2_fields, norm_offset=1.0),
    "gemma3": _Family("Gemma3ForCausalLM", "gemma3_text", _gemma3_fields, norm_offset=1.0),
}
_MISTRAL = _Family("MistralForCausalLM", "mistral", _mistral_fields, rope_permuted=True)


def _hf_parameters(header: _Header, config: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (parameter name, shape) for each parameter of the model `config` describes.

    Named the way llama.cpp's converter names them: gguf's own tensor-name table applied to the
    parameters of the transformers model, built on the meta device so it takes no memory.
    """
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == header.arch)
    name_map = get_tensor_name_map(arch, config["num_hidden_layers"])
    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    parameters = {}
    # Tied output weights are one parameter, listed once under the embedding's name.
    for hf_name, parameter in model.named_parameters():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelLoadError(f"{header.path}: no GGUF tensor name is known for {hf_name} of {type(model).__name__}")
        parameters[gguf_name] = (hf_name, tuple(parameter.shape))
    return parameters


def _dequantized(tensor: ReaderTensor, path: Path) -> np.ndarray:
    """The tensor as float32, dimensions in PyTorch's order (outermost first)."""
    from gguf.quants import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name}: unsupported quantization {tensor.tensor_type.name}"
        ) from exc
    # GGUF lists dimensions innermost first.
    return weights.reshape(tuple(reversed(tensor.shape.tolist())))


def _undo_rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head's rows in Q and K;
    # put them back into the split-half order that transformers' rotary embedding expects.
    head_half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, head_half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _as_in_checkpoint(family: _Family, config: dict[str, Any], gguf_name: str, weights: np.ndarray) -> np.ndarray:
    """The tensor as the Hugging Face checkpoint holds it, undoing llama.cpp's conversion-time changes."""
    if family.rope_permuted and gguf_name.endswith((".attn_q.weight", ".attn_q.bias")):
        weights = _undo_rope_permute(weights, config["num_attention_heads"])
    elif family.rope_permuted and gguf_name.endswith((".attn_k.weight", ".attn_k.bias")):
        weights = _undo_rope_permute(weights, config["num_key_value_heads"])
    elif family.norm_offset and gguf_name.endswith("norm.weight"):
        weights = weights - family.norm_offset
    # A copy: F32 tensors come back as views of the memory-mapped file.
    return np.array(weights, dtype=np.float32, order="C")


def _hf_tensors(header: _Header, family: _Family, config: dict[str, Any]) -> dict[str, np.ndarray]:
    parameters = _hf_parameters(header, config)
    converted: dict[str, np.ndarray] = {}
    for tensor in tqdm(header.reader.tensors, desc="Converting GGUF", unit="tensor"):
        if tensor.name in family.config_tensors:
            continue
        if tensor.name not in parameters:
            raise ModelLoadError(
                f"{header.path}: unexpected tensor {tensor.name!r} in a {header.arch} GGUF ({family.hf_class})"
            )
        hf_name, shape = parameters[tensor.name]
        weights = _dequantized(tensor, header.path)
        if weights.shape != shape:
            raise ModelLoadError(
                f"{header.path}: tensor {tensor.name} has shape {weights.shape}; {family.hf_class} expects {shape}"
            )
        converted[hf_name] = _as_in_checkpoint(family, config, tensor.name, weights)
    missing = sorted(name for name, (hf_name, _) in parameters.items() if hf_name not in converted)
    if missing:
        raise ModelLoadError(f"{header.path}: GGUF lacks tensor(s) {', '.join(missing)} that {family.hf_class} needs")
    return converted


def _quantized_tensors(header: _Header, family: _Family, config: dict[str, Any],
                       ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The matrices stored in a GGML quantized type, as their raw blocks: HF name -> uint8 [rows,
    bytes per row] (rows in the checkpoint's order: Llama's Q/K rotary permutation undone on whole
    rows), and HF name -> GGML type name. What the engine serves quantized; model.safetensors
    keeps the float32 values of the same tensors for everything else."""
    from gguf import GGMLQuantizationType

    parameters = _hf_parameters(header, config)
    raw: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for tensor in header.reader.tensors:
        kind = GGMLQuantizationType(tensor.tensor_type)
        if kind.name not in QUANTIZED_TYPES or len(tensor.shape) != 2 or tensor.name not in parameters:
            continue
        hf_name, _ = parameters[tensor.name]
        blocks = np.asarray(tensor.data, dtype=np.uint8)
        if family.rope_permuted and tensor.name.endswith(".attn_q.weight"):
            blocks = _undo_rope_permute(blocks, config["num_attention_heads"])
        elif family.rope_permuted and tensor.name.endswith(".attn_k.weight"):
            blocks = _undo_rope_permute(blocks, config["num_key_value_heads"])
        raw[hf_name] = np.ascontiguousarray(blocks)
        types[hf_name] = kind.name
    return raw, types


def _write_tokenizer(reader: GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    # Imported here: transformers is slow to import and only needed when converting.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # Saved as the generic class, whose tokenizer.json is the whole pipeline: a model's own class
    # (GemmaTokenizer, ...) rebuilds its normalizer and pre-tokenizer on reload, which breaks a
    # vocabulary of another kind than the family's usual one (a Gemma 3 GGUF may hold byte-level BPE).
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=loaded.backend_tokenizer,
        **{key: getattr(loaded, key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")},
    )
    tokenizer.chat_template = loaded.chat_template or _metadata(reader, "tokenizer.chat_template")
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
