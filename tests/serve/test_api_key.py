"""`serve --api-key`: a real server on 127.0.0.1 whose /v1/* routes answer 401 (OpenAI's error shape) without the
key or with a wrong one, and serve the real openai client that sends it; /health and /metrics stay open. The key
reaches the child process through its environment, never its command line."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import SERVER_SETTINGS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "sk-test-7f3a"


@pytest.fixture(scope="module")
def keyed_server(default_model_dir):
    from exl2_backend.serve.server import ServerProcess

    with ServerProcess({**SERVER_SETTINGS, "api_key": KEY, "max_batch_size": 2}, startup_timeout=900) as srv:
        yield srv


def test_v1_needs_the_key_and_probes_do_not(keyed_server):
    base = keyed_server.base_url
    assert KEY not in " ".join(keyed_server.proc.args)
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        r = http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["count"] > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content
