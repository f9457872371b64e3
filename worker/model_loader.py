"""Load a model's weights from a Hugging Face-format directory into the shared decoder (worker/model.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.model import DecoderForCausalLM, ModelConfig
from metroserve.worker.model_files import ModelLoadError
from metroserve.worker.quantization import (
    KERNEL_TYPES,
    QUANTIZED_FILE,
    make_weight,
    quantize_q8_0,
    read_gguf_blocks,
)

logger = logging.getLogger(__name__)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
               matmul_dtype: torch.dtype | None = None, quantized_activations: str = "float32") -> DecoderForCausalLM:
    """The decoder for the directory's config with its safetensors weights, showing a progress bar
    over tensors; projections quantized as `quantization` says, taking inputs as
    `quantized_activations` says (worker/quantization.py), or with
    matmul_dtype bfloat16 (CPU, float32 dtype) kept and multiplied in bfloat16 (pack_cpu_weights)."""
    try:
        cfg = ModelConfig.from_dir(model_dir)
    except (KeyError, ValueError, OSError) as e:
        raise ModelLoadError(f"{model_dir}/config.json: {e}") from e
    files = sorted(f for f in model_dir.glob("*.safetensors") if f.name != QUANTIZED_FILE)
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weight files")
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    # Built on the meta device to skip random init; RoPE frequencies are computed, not loaded.
    model.init_rope(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    handles = []
    try:
        for f in files:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        total = sum(len(list(h.keys())) for _, h in handles)
        with tqdm(total=total, desc=f"Loading {model_dir.name}", unit="tensor", leave=False) as bar:
            for _, handle in handles:
                for name in handle.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                    filled = model.load_hf_tensor(name, handle.get_tensor(name), params)
                    if filled is not None:
                        loaded.add(filled)
                    bar.update(1)
    except ModelLoadError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or corrupt files
        raise ModelLoadError(f"cannot read weights from {model_dir}: {type(e).__name__}: {e}") from e
    missing = model.missing_loads(loaded)
    if missing:
        raise ModelLoadError(f"{model_dir} lacks {len(missing)} weight tensors, e.g. {sorted(missing)[:3]}")
    kernels = load_cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
    served = False
    if matmul_dtype is None:
        served = _quantize(model, model_dir, quantization, kernels, quantized_activations)
    elif quantization not in (None, "none"):
        raise ModelLoadError(f"--quantization {quantization}: quantized weights need float32 on CPU "
                             "(their kernel multiplies in float32), not --dtype bfloat16")
    elif (model_dir / QUANTIZED_FILE).is_file():
        logger.info("%s: --dtype bfloat16: the GGUF's quantized matrices are served dequantized, in bfloat16",
                    model_dir.name)
    if quantized_activations == "int8" and not served:
        raise ModelLoadError("--quantized-activations int8 applies to projections served quantized, and this "
                             "model serves none (a float checkpoint, --quantization none, --dtype bfloat16 or not "
                             "on CPU); --quantization int8 quantizes any model")
    model.pack_cpu_weights(matmul_dtype)
    if kernels is not None:
        model.use_cpu_kernels(kernels)
    logger.info("%s: weights resident: %.0f MiB", model_dir.name, model.resident_bytes() / 2**20)
    return model.eval()


def _quantize(model: DecoderForCausalLM, model_dir: Path, quantization: str | None, kernels,
              quantized_activations: str) -> bool:
    """Serve the projections quantized that `quantization` asks for, when the kernels can; returns
    whether any is."""
    if quantization == "none":
        return False
    blocks, types = ({}, {}) if quantization == "int8" else read_gguf_blocks(model_dir)
    if quantization is None and not blocks:
        return False  # an unquantized checkpoint, served as it is
    if quantization == "gguf" and not blocks:
        raise ModelLoadError(f"{model_dir}: --quantization gguf needs a GGUF model with quantized matrices")
    if kernels is None or not hasattr(kernels, "quant_linear"):
        message = "quantized weights need the compiled CPU kernels and float32 on CPU"
        if quantization is not None:
            raise ModelLoadError(f"--quantization {quantization}: {message}")
        logger.warning("%s: %s; serving the dequantized float weights", model_dir.name, message)
        return False
    int8 = quantized_activations == "int8"
    if int8 and not kernels.int8_gemm_available():
        raise ModelLoadError("--quantized-activations int8 needs CPU kernels built for AVX2 or AVX-512 "
                             "(integer dot products); this build is portable")
    served: dict[str, int] = {}  # parts per GGML type
    for name, ways in tqdm(model.projection_sources().items(), desc="Quantizing" if quantization == "int8"
                           else "Packing quantized weights", unit="projection", leave=False):
        if quantization == "int8":
            shards = [(quantize_q8_0(model.projection_weight(name)), "Q8_0")]
        else:
            found = next((w for w in ways if all(types.get(t) in KERNEL_TYPES for t in w)), None)
            if found is None:
                continue  # stored unquantized, or in a type the kernel lacks: served as float
            shards = [(blocks[t], types[t]) for t in found]
        for _, kind in shards:
            served[kind] = served.get(kind, 0) + 1
        model.set_quantized(name, make_weight(shards, kernels, int8))
    logger.info("%s: projections served quantized: %s; %s inputs", model_dir.name,
                ", ".join(f"{n} in {kind}" for kind, n in sorted(served.items())) or "none",
                "int8" if int8 else "float32")
    return bool(served)
