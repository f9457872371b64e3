"""The throughput benchmark's vllm peer (benchmarks/throughput.py run_vllm) against a stand-in `vllm`
package on PYTHONPATH: what it hands vLLM's process (the model directory without the engine's own
safetensors, the token-id prompts, vLLM's CPU environment) and how it reads the answer back from
output that vLLM's log lines surround."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from metroserve.benchmarks.throughput import run_vllm
from metroserve.worker.quantization import QUANTIZED_FILE

# Records what it was given; each output is the prompt's last id, then 7 (the EOS here), then 8.
FAKE_VLLM = textwrap.dedent('''
    import json, os, pathlib, sys
    __version__ = "0.0-fake"
    class SamplingParams:
        def __init__(self, temperature, max_tokens):
            self.max_tokens = max_tokens
    class _Out:
        def __init__(self, ids):
            self.outputs = [type("Completion", (), {"token_ids": ids})()]
    class LLM:
        def __init__(self, model_dir, dtype, max_model_len, seed):
            print("INFO log line before the result")
            env = os.environ.get
            record = {"files": sorted(p.name for p in pathlib.Path(model_dir).iterdir()), "dtype": dtype,
                      "bind": env("VLLM_CPU_OMP_THREADS_BIND"), "kv": env("VLLM_CPU_KVCACHE_SPACE")}
            pathlib.Path(os.environ["FAKE_VLLM_RECORD"]).write_text(json.dumps(record))
        def generate(self, prompts, params, use_tqdm):
            return [_Out([p["prompt_token_ids"][-1], 7, 8][: params.max_tokens]) for p in prompts]
''')
FAKE_INPUTS = "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"


def test_vllm_peer_runs_the_prompts_in_vllms_process(tmp_path, monkeypatch):
    import json

    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text(FAKE_INPUTS)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", QUANTIZED_FILE):
        (model_dir / name).write_text("{}")
    record = tmp_path / "record.json"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))

    result = run_vllm(sys.executable, model_dir, [[1, 2, 3], [4, 5]], [9], 128, [7], torch.bfloat16)

    assert result.outputs == [[3, 7], [5, 7]]  # trimmed at the first EOS, as every peer's
    assert result.extra["version"] == "0.0-fake" and result.seconds >= 0
    seen = json.loads(record.read_text())
    assert seen["files"] == ["config.json", "model.safetensors", "tokenizer.json"]  # no quantized.safetensors
    assert seen["dtype"] == "bfloat16" and seen["kv"] == "4"
    assert seen["bind"] == f"0-{torch.get_num_threads() - 1}"


def test_vllm_peer_reports_vllms_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no vllm there
    (tmp_path / "model").mkdir()
    with pytest.raises(RuntimeError, match="vllm exited with 1"):
        run_vllm(sys.executable, tmp_path / "model", [[1]], [1], 4, [7], torch.float32)
