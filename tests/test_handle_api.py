"""The Python handle API: vLLM's request and response models, streaming, and a second Ray driver."""

from __future__ import annotations

import os
import subprocess
import sys

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse

from tests.conftest import REPO_ROOT


def test_typed_chat_through_the_handle(tiny_app):
    request = ChatCompletionRequest(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    response = tiny_app.ingress.chat.remote(request).result(timeout_s=120)
    assert isinstance(response, ChatCompletionResponse)
    assert response.usage.prompt_tokens > 0 and response.kvrelay.mode in ("local", "pull", "recompute")


def test_streaming_chat_through_the_handle(tiny_app):
    request = ChatCompletionRequest(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    stream=True, temperature=0, ignore_eos=True)
    chunks = list(tiny_app.ingress.options(stream=True).chat.remote(request))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "kvrelay" in chunks[-1]


def test_a_separate_ray_driver_uses_the_example_client(tiny_app, ray_cluster):
    address = ray_cluster.get_runtime_context().gcs_address
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for extra in ([], ["--stream"]):
        out = subprocess.run(
            [sys.executable, "-m", "app.handle_example", "--address", address, "--app", tiny_app.name,
             "--model", "tiny-llama", "--max-tokens", "4", *extra],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "[plan]" in out.stdout
