"""One real server (LitServe + the default model on CPU, 127.0.0.1, a free port) shared by the serve tests."""

from __future__ import annotations

import pytest

# max_queue=0: a 17th concurrent request (beyond max_batch_size=16) is refused with 503 at once.
SERVER_SETTINGS = {"device": "cpu", "max_seq_len": 512, "cache_tokens": 16384, "max_batch_size": 16,
                   "max_queue": 0, "log_level": "warning", "max_payload_mb": 2}


@pytest.fixture(scope="session")
def server(default_model_dir):
    from exl2_backend.serve.server import ServerProcess

    with ServerProcess(SERVER_SETTINGS, startup_timeout=900) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def http(server):
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c
