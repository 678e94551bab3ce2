"""Fixtures for the server tests: real servers on free ports and the openai SDK pointed at them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_helpers import ADMIN, API_KEY, start_server  # noqa: E402

TRAFFIC = {
    "tokenBudget": 256,
    "trafficClusters": [
        {
            "name": "chat",
            "match": {"header": "chat"},
            "slo": {"ttftP99Seconds": 2.0, "tbtP99Seconds": 0.5},
            "chunkCap": 128,
            "maxWaiting": 64,
            "priority": 1,
        },
        {"name": "summarize", "match": {"minPromptTokens": 200}, "chunkCap": 64},
    ],
}


@pytest.fixture(scope="module")
def server(default_model):
    """The main server: API key, admin token, a `chat` and a `summarize` cluster."""
    s = start_server(default_model, traffic=TRAFFIC)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def admin_headers():
    return {"Authorization": f"Bearer {ADMIN}"}
