"""The gateway and the scheduler stay light: they never load torch, matplotlib or transformers' model
code, neither when their modules import nor when the CLI builds its parser, and a serving gateway
holds well under 150 MiB. Each check runs in a fresh interpreter: this one has torch loaded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.stack import ROOT, free_port, wait_for

HEAVY = ("torch", "matplotlib", "transformers.models")
GATEWAY_RSS_LIMIT_KIB = 150 * 1024


def _heavy_modules(code: str) -> list[str]:
    """The heavy modules loaded after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    loaded = json.loads(out.splitlines()[-1])
    return [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_service_modules_import_no_heavy_code():
    assert _heavy_modules("import metroserve.services.gateway, metroserve.scheduler.server") == []


def test_cli_parses_service_commands_without_heavy_code():
    code = """
import contextlib, io
from metroserve.services.cli import build_parser, main
parser = build_parser()
assert parser.parse_args(["gateway"]).command == "gateway"
assert parser.parse_args(["scheduler", "--port", "1"]).port == 1
for argv in (["gateway", "--help"], ["scheduler", "--help"], ["--help"], ["bench", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: metroserve" in out.getvalue()
"""
    assert _heavy_modules(code) == []


@pytest.mark.service
def test_serving_gateway_is_light_and_tokenizes_as_transformers(tiny_model_dir):
    from transformers import AutoTokenizer

    from metroserve.common.chat import chat_prompt_ids

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    expected = chat_prompt_ids(AutoTokenizer.from_pretrained(str(tiny_model_dir)), messages)
    port = free_port()
    # No scheduler listens on the given port: /tokenize needs only the gateway's tokenizer.
    gateway = subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", "gateway", "--model",
                                str(tiny_model_dir), "--scheduler", f"127.0.0.1:{free_port()}", "--port", str(port),
                                "--grpc-port", str(free_port())], cwd=ROOT)
    try:
        def tokenize():
            assert gateway.poll() is None, f"the gateway exited with {gateway.returncode}"
            body = json.dumps({"messages": messages}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError:
                raise  # up, but the request was wrong
            except (urllib.error.URLError, ConnectionError):  # not listening yet
                return None

        assert wait_for(tokenize, 60, "the gateway's /tokenize")["tokens"] == expected
        with open(f"/proc/{gateway.pid}/maps") as f:
            assert "libtorch" not in f.read()
        with open(f"/proc/{gateway.pid}/status") as f:
            rss_kib = int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
        assert rss_kib < GATEWAY_RSS_LIMIT_KIB, f"gateway RSS {rss_kib} KiB"
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)
