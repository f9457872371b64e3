"""Prompt text reaches no log unless asked, and then only the gateway's, cut to --max-log-len; the
API key reaches neither a log nor a command line.

Each test runs a mock-worker cluster (real processes), sends a completion, a chat completion and a
gRPC Generate whose prompts hold a planted secret, then stops the cluster (which flushes every
process's block-buffered log) and reads all of the logs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import openai
import pytest

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from metroserve.services.serve import ServeOptions, Stack
from metroserve.worker.config import EngineConfig
from tests.mock_cluster import MODEL, start_mock_cluster, stop_mock_cluster

pytestmark = pytest.mark.service

SECRET = "hunter2-planted-password"
PROMPT = f"Remember that my password is {SECRET}"


def _run_and_read_logs(tiny_model_dir, log_dir, gateway_args: tuple[str, ...] = ()) -> dict[str, str]:
    cluster = start_mock_cluster(tiny_model_dir, log_dir, gateway_args=gateway_args)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices
        assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=3).choices
        with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
            replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
                model=MODEL, text=PROMPT, params=generation_pb2.SamplingParams(max_tokens=3)), timeout=30))
        assert replies
    finally:
        stop_mock_cluster(cluster)
    return {path.stem: path.read_text() for path in log_dir.glob("*.log")}


def _prompt_records(log: str) -> list[dict]:
    return [json.loads(line.split("metroserve.prompts: ", 1)[1]) for line in log.splitlines()
            if "metroserve.prompts: " in line]


def test_no_prompt_text_in_any_log_by_default(tiny_model_dir, tmp_path):
    logs = _run_and_read_logs(tiny_model_dir, tmp_path)
    assert set(logs) == {"scheduler", "worker", "gateway"}
    assert "request_finished" in logs["scheduler"]  # requests are logged, as counts and timings
    for name, log in logs.items():
        assert SECRET not in log and "password" not in log, f"prompt text in the {name}'s log"
        assert not _prompt_records(log)


def test_enable_log_prompts_logs_each_request_at_the_gateway_cut_to_max_log_len(tiny_model_dir, tmp_path):
    logs = _run_and_read_logs(tiny_model_dir, tmp_path, ("--enable-log-prompts", "--max-log-len", "24"))
    records = _prompt_records(logs["gateway"])
    assert len(records) == 3, records  # completion, chat completion, gRPC: one line each
    kinds = sorted(r["request_id"].split("-", 1)[0] for r in records)
    assert kinds == ["chatcmpl", "cmpl", "grpc"]
    for record in records:
        (prompt,) = record["prompts"]
        assert len(prompt["text"]) == 24 and prompt["tokens"] > 0
    assert records[0]["prompts"][0]["text"] == PROMPT[:24]  # the completion's text as the model reads it
    for name, log in logs.items():
        assert SECRET not in log, f"more than --max-log-len characters of a prompt in the {name}'s log"
    assert all("metroserve.prompts" not in logs[name] for name in ("scheduler", "worker"))


def test_serve_hands_the_api_key_to_the_gateway_by_environment_not_command_line():
    stack = Stack(ServeOptions(engine=EngineConfig(device="cpu"), served_model_name="m", api_key="sk-planted"))
    assert "sk-planted" not in " ".join(stack._gateway_argv())
    env = stack._gateway_env()
    assert env is not None and env["METROSERVE_API_KEY"] == "sk-planted"
    assert Stack(ServeOptions(engine=EngineConfig(device="cpu"), served_model_name="m"))._gateway_env() is None


def test_max_log_len_needs_enable_log_prompts():
    proc = subprocess.run([sys.executable, "-m", "metroserve.services.cli", "gateway", "--max-log-len", "10"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--max-log-len needs --enable-log-prompts" in proc.stderr
