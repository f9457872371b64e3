"""Tokenizer loading, shared by the engine and the gateway (which must not load torch).

transformers' AutoTokenizer imports torch (through its model config code) before it picks a class.
A directory whose tokenizer_config.json names the generic tokenizers-backed class (what converted
GGUFs, the benchmarks' random models and Llama-3-style checkpoints declare) loads that class
directly, from tokenizer.json as saved; for these AutoTokenizer picks the same class, except for
the few model types whose hub configs it overrides with a model-specific class. Any other declared
class goes through AutoTokenizer, which knows each model's quirks and loads torch. The engine
loads its tokenizer here too, so the gateway's token ids are always the engine's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
from pathlib import Path

from metroserve.worker.model_files import ModelLoadError

# Both names mean transformers 5's TokenizersBackend, which reads tokenizer.json as is.
_GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _declared_class(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def _tokenizer_class(model_dir: Path):
    if _declared_class(model_dir) in _GENERIC_CLASSES and (model_dir / "tokenizer.json").is_file():
        from transformers import TokenizersBackend

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


def _return_freed_heap() -> None:
    """Loading parses tokenizer.json (MBs of JSON) in Python and again in Rust; glibc keeps the
    freed heap (about 30 MiB for SmolLM2) unless asked to give it back to the OS."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load_tokenizer(model_dir: Path):
    """The Hugging Face tokenizer in a converted model directory; ModelLoadError if it cannot load."""
    try:
        tokenizer = _tokenizer_class(model_dir).from_pretrained(str(model_dir))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from e
    _return_freed_heap()
    return tokenizer
