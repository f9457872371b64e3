"""Shared fixtures: a tiny random-weight Llama (GQA) with a small trained tokenizer, the SmolLM2
checkpoint, and Hugging Face reference generation to compare against."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. triton.jit reads this
# when a kernel is defined, so it is set before any test imports worker.attention.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The cluster secret every process a test starts (in-process or as a child) authenticates with.
os.environ.setdefault("METROSERVE_CLUSTER_SECRET", secrets.token_urlsafe(16))

from metroserve.benchmarks.random_model import write_random_llama  # noqa: E402
from tests.reference import HFReference  # noqa: E402


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with GQA (4 query heads over 2 KV heads) and a 512-token byte-level BPE."""
    return write_random_llama(path, "tiny", seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from metroserve.worker.model_files import ModelLoadError, resolve_model_dir

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
