"""The HTTP surfaces fuzzed over real HTTP (issue 30): the env server and the actor's
OpenAI-compatible endpoint each take a thousand requests of any method, path, query and body
(random bytes, any JSON, the protocol's fields with values of any type, ids and session keys
that exist and that do not). Each gets an answer below 500 whose body is JSON, an error saying
what is wrong where it is 4xx (a streamed answer is an event stream); a body over the size
limit gets a 413 in the same JSON; each server answers after them, and the env server holds
no more envs than were created."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse

import aiohttp
import pytest
from aiohttp import web

from actors.episode import ModelPolicy
from actors.gateway import Gateway
from actors.weights import WeightGate
from broker.embedded import free_port
from envs.server import EnvServer
from tests.integration.test_gateway import ScriptedEngine
from tests.unit.test_chat import chatml_tokenizer

hypothesis = pytest.importorskip("hypothesis", reason="the test extra is not installed (pip install -e .[test])")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROUTES = ["/", "/stats", "/create", "/reset", "/step", "/observation", "/oracle", "/random", "/mistake", "/actions", "/close"]
FIELDS = ["id", "data_idx", "action", "seed"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10)


class Served:
    """`make_app()`'s application on a loopback port, on its own event loop in a thread, and an
    aiohttp client session on that loop for the test's synchronous body."""

    def __init__(self, make_app):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.runner, self.session = self.call(self._start(make_app))

    async def _start(self, make_app):
        runner = web.AppRunner(make_app(), access_log=None)  # made on the loop it serves on
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def request(self, method: str, path: str, body: bytes | None = None, params=None) -> tuple[int, str, bytes]:
        async def go():
            async with self.session.request(method, self.base + path, data=body, params=params,
                                            headers={"Content-Type": "application/json"}) as resp:
                return resp.status, resp.content_type, await resp.read()

        return self.call(go())

    def close(self):
        self.call(self.session.close())
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served():
    server = EnvServer("letters", {"turns": 2, "alphabet": "ab"})
    served = Served(server.app)
    served.server = server
    live = []
    for data_idx in range(3):  # envs to aim at: one reset, one stepped to its end, one fresh
        status, _, body = served.request("POST", "/create")
        env_id = json.loads(body)["id"]
        live.append(env_id)
        if data_idx < 2:
            served.request("POST", "/reset", json.dumps({"id": env_id, "data_idx": data_idx}).encode())
    for _ in range(2):
        served.request("POST", "/step", json.dumps({"id": live[1], "action": "a\n"}).encode())
    served.live = tuple(live)  # fixed: hypothesis replays a case only if its strategy stays the same
    served.created = 3
    yield served
    served.close()


def _answered_in_json(status: int, content_type: str, body: bytes, what: str) -> None:
    assert status < 500, (status, body[:300], what)
    if status == 200 and content_type == "text/event-stream":  # a streamed completion
        assert body.rstrip().endswith(b"data: [DONE]"), (body[-300:], what)
        return
    assert content_type == "application/json", (status, content_type, body[:300], what)
    answer = json.loads(body)
    if status >= 400:
        assert isinstance(answer, dict) and answer.get("error"), (status, answer, what)


def bodies(fields):
    """None, random bytes, any JSON, or a JSON object of the protocol's `fields` with any values."""
    return (st.none() | st.binary(max_size=512) | json_values.map(lambda v: json.dumps(v).encode())
            | fields.map(lambda f: json.dumps(f).encode()))


@st.composite
def requests(draw, live):
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    path = draw(st.sampled_from(ROUTES) | st.from_regex(r"/[a-z0-9_./%-]{0,24}", fullmatch=True))
    ids = st.sampled_from(live) | st.integers(-2**40, 2**40)
    body = draw(bodies(st.dictionaries(st.sampled_from(FIELDS), json_values | ids, max_size=4)))
    params = draw(st.dictionaries(st.sampled_from(FIELDS), (ids | st.text(max_size=12)).map(str), max_size=2))
    return method, path, body, params


def test_any_request_gets_an_answer_in_json_below_500(served):
    @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
    @given(st.data())
    def fuzz(data):
        method, path, body, params = data.draw(requests(served.live))
        status, content_type, answer = served.request(method, urllib.parse.quote(path, safe="/%"), body, params)
        what = f"{method} {path} params={params} body={body[:200] if body else body!r}"
        _answered_in_json(status, content_type, answer, what)
        if method == "POST" and path == "/create" and status == 200:
            served.created += 1

    fuzz()
    # A body over the server's limit: refused in the same JSON, the server unharmed.
    status, content_type, body = served.request("POST", "/step", b"{" + b" " * (2 * 1024 * 1024) + b"}")
    assert status == 413
    _answered_in_json(status, content_type, body, "2 MiB body")
    status, content_type, body = served.request("GET", "/")
    assert status == 200 and "letters" in body.decode()
    assert len(served.server.instances) <= served.created


GATEWAY_FIELDS = ["messages", "prompt", "max_tokens", "temperature", "stream", "stream_options", "tools", "stop",
                  "n", "model", "logprobs", "reward", "tool_choice"]
messages = st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]),
                                    st.sampled_from(["user", "assistant", "system", "tool"]) | json_values,
                                    max_size=3), max_size=3)


@st.composite
def gateway_requests(draw, key):
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    session = draw(st.just(key) | st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True))
    path = draw(st.sampled_from(["/v1/models", f"/sessions/{session}/v1/models",
                                 f"/sessions/{session}/v1/chat/completions", f"/sessions/{session}/v1/completions",
                                 f"/sessions/{session}/reward"])
                | st.from_regex(r"/[a-z0-9_./-]{0,24}", fullmatch=True))
    body = draw(bodies(st.dictionaries(st.sampled_from(GATEWAY_FIELDS), json_values | messages, max_size=5)))
    return method, path, body


def test_any_request_to_the_endpoint_gets_an_answer_below_500():
    engine = ScriptedEngine(chatml_tokenizer(), ["ok"] * 100_000)
    holder = {}

    def make_app():
        gateway = Gateway(engine, ModelPolicy(engine, WeightGate(3)), 256, "tiny")
        holder["gateway"] = gateway
        return gateway.app()

    served = Served(make_app)
    try:
        key = served.call(_open(holder["gateway"]))

        @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(gateway_requests(key))
        def fuzz(request):
            method, path, body = request
            status, content_type, answer = served.request(method, urllib.parse.quote(path, safe="/%"), body)
            _answered_in_json(status, content_type, answer, f"{method} {path} body={body[:200] if body else body!r}")

        fuzz()
        status, content_type, body = served.request("POST", f"/sessions/{key}/v1/chat/completions",
                                                    b"[" + b" " * (65 * 1024 * 1024) + b"]")
        assert status == 413
        _answered_in_json(status, content_type, body, "65 MiB body")
        status, _, body = served.request("GET", "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    finally:
        served.close()


async def _open(gateway) -> str:
    return gateway.open().key
