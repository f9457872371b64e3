"""Tokenizer loading, shared by the engine and the gateway (which must not load torch)."""

from __future__ import annotations

from pathlib import Path

from metroserve.worker.model_files import ModelLoadError


def load_tokenizer(model_dir: Path):
    """The Hugging Face tokenizer in a converted model directory; ModelLoadError if it cannot load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from e
