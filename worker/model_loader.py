"""Load a model's weights from a Hugging Face-format directory into the shared decoder (worker/model.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.model import DecoderForCausalLM, ModelConfig
from metroserve.worker.model_files import ModelLoadError


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """The decoder for the directory's config with its safetensors weights, showing a progress bar over tensors."""
    try:
        cfg = ModelConfig.from_dir(model_dir)
    except (KeyError, ValueError, OSError) as e:
        raise ModelLoadError(f"{model_dir}/config.json: {e}") from e
    files = sorted(model_dir.glob("*.safetensors"))
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
    model.pack_cpu_weights()
    if device.type == "cpu" and dtype == torch.float32:
        kernels = load_cpu_kernels()
        if kernels is not None:
            model.use_cpu_kernels(kernels)
    return model.eval()
