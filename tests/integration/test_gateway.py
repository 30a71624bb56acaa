"""The actor's OpenAI-compatible endpoint (actors/gateway.py), driven by the official `openai`
client over real HTTP: chat, completions, streaming, tool calls through Qwen3's chat template,
OpenAI's errors for bad requests; and what each session captures, token-exactly: one sequence
while the prompts extend it (ChatML), a new segment where the template rewrites history
(Qwen3 drops earlier reasoning). A scripted engine stands in for vLLM, so the tokens sampled
are known; the tokenizers are the character ones of tests/unit/test_chat.py."""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from actors.engine import Generation, find_stop
from actors.episode import ModelPolicy
from actors.gateway import Gateway
from actors.weights import WeightGate
from broker.embedded import free_port
from common.http import runner_for
from tests.unit.test_chat import chatml_tokenizer, qwen3_tokenizer

openai = pytest.importorskip("openai")
VERSION = 3


class ScriptedEngine:
    """Samples the next scripted reply (its text's tokens, cut at max_tokens and after a stop
    string, as VLLMEngine cuts them), log-prob -0.25 each; keeps every prompt it was given. Its
    own stop strings are an actor's ("\n"): the gateway replaces them with the request's. A
    reply "RAISE" fails, as an engine can."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts, self.stops = tokenizer, list(replies), [], ["\n"]

    async def generate(self, prompt_ids, max_tokens, temperature=None, turn_start=None, sent=None,
                       stops=None, choices=None) -> Generation:
        self.prompts.append(list(prompt_ids))
        if sent is not None:
            sent()
        reply = self.replies.pop(0)
        if reply == "RAISE":
            raise RuntimeError("the engine died")
        ids = self.tokenizer.encode(reply, add_special_tokens=False)[:max_tokens]
        stops = self.stops if stops is None else stops
        end = find_stop(self.tokenizer.decode, ids, stops, 0) if stops else None
        if end is not None:
            return Generation(ids[:end], [-0.25] * end, "stop")
        return Generation(ids, [-0.25] * len(ids), "stop" if len(ids) < max_tokens else "length")


def serve_gateway(tokenizer, replies: list[str], scenario, max_seq_len: int = 4096):
    """Runs `scenario(gateway, base_url, engine)` against the endpoint on a free port."""
    engine = ScriptedEngine(tokenizer, replies)

    async def main():
        gateway = Gateway(engine, ModelPolicy(engine, WeightGate(VERSION)), max_seq_len, "tiny")
        runner = runner_for(gateway.app(), handler_cancellation=True)  # as actors/agents.py serves it
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await scenario(gateway, f"http://127.0.0.1:{port}", engine)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def client(root: str, key: str) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=f"{root}/sessions/{key}/v1", api_key="unused", max_retries=0)


def render(tokenizer, messages, **kw) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)


def test_a_multi_turn_chat_is_one_sequence_of_exactly_the_sampled_tokens():
    tokenizer = chatml_tokenizer()
    replies = ["<action>b</action><|im_end|>", "<action>c</action><|im_end|>"]

    async def scenario(gateway, root, engine):
        session = gateway.open("s1")
        llm = client(root, "s1")
        messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Say b."}]
        first = await llm.chat.completions.create(model="tiny", messages=messages, temperature=0.7)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now c."}]
        second = await llm.chat.completions.create(model="tiny", messages=messages, logprobs=True)
        messages.append({"role": "assistant", "content": second.choices[0].message.content})
        models = await llm.models.list()
        assert await gateway.close("s1") is session and session.closed
        with pytest.raises(openai.NotFoundError):  # closed: later calls are not captured
            await llm.chat.completions.create(model="tiny", messages=messages)
        return session, first, second, messages, models

    session, first, second, messages, models = serve_gateway(tokenizer, replies, scenario)
    assert first.choices[0].message.content == "<action>b</action>" and first.choices[0].finish_reason == "stop"
    assert second.usage.completion_tokens == len(tokenizer.encode(replies[1], add_special_tokens=False))
    assert [t.logprob for t in second.choices[0].logprobs.content] == [-0.25] * second.usage.completion_tokens
    assert [m.id for m in models.data] == ["tiny"]
    assert (session.calls, session.extended, session.splits, len(session.segments)) == (2, 1, 0, 1)
    (segment,) = session.segments
    # The whole conversation as the template renders it, up to the last sampled token (<|im_end|>).
    assert segment.tokens == render(tokenizer, messages)[:len(segment.tokens)]
    assert len(segment.tokens) == len(render(tokenizer, messages)) - 1  # the template's "\n" after it
    sampled = [tokenizer.encode(r, add_special_tokens=False) for r in replies]
    generated = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
    assert generated == sampled[0] + sampled[1]  # exactly as sampled, nothing re-tokenised
    assert segment.tokens[-len(sampled[1]):] == sampled[1] and all(segment.loss_mask[-len(sampled[1]):])
    assert {v for v, m in zip(segment.versions, segment.loss_mask) if m} == {VERSION}
    assert {lp for lp, m in zip(segment.logprobs, segment.loss_mask) if m} == {-0.25}


def test_a_template_that_rewrites_history_starts_a_new_segment_and_tool_calls_round_trip():
    tokenizer = qwen3_tokenizer()
    tokenizer.add_tokens(["{", "}"])  # JSON's braces, which the character vocabulary lacks
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
    replies = ["<think>\nadd them\n</think>\n\n" + call, "It is 3.<|im_end|>", "4.<|im_end|>", "Three.<|im_end|>"]
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]

    async def scenario(gateway, root, engine):
        session = gateway.open("s2")
        llm = client(root, "s2")
        messages = [{"role": "user", "content": "What is 1 + 2?"}]
        first = await llm.chat.completions.create(model="tiny", messages=messages, tools=tools)
        answer = first.choices[0].message
        messages += [answer.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "3"}]
        stream = await llm.chat.completions.create(model="tiny", messages=messages, tools=tools, stream=True,
                                                   stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        messages += [{"role": "assistant", "content": "".join(c.choices[0].delta.content or "" for c in chunks
                                                              if c.choices)},
                     {"role": "user", "content": "And 2 + 2?"}]
        await llm.chat.completions.create(model="tiny", messages=messages)
        plain = await llm.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=50)
        return session, first, chunks, plain, engine

    session, first, chunks, plain, engine = serve_gateway(tokenizer, replies, scenario)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "<think>\nadd them\n</think>"
    (tool_call,) = message.tool_calls
    assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {"a": 1, "b": 2}
    assert '"name": "add"' in tokenizer.decode(engine.prompts[0])  # the tools rendered by the template
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "It is 3." and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(tokenizer.encode(replies[1], add_special_tokens=False))
    # The tool's answer extends the first call's tokens (Qwen3 keeps the reasoning of the turns
    # after the newest user message); a new user message makes its template drop that <think>
    # block, so the third prompt does not extend the tokens so far: a segment of its own, whole.
    assert (session.calls, session.extended, session.splits, len(session.segments)) == (4, 1, 2, 3)
    assert "<tool_response>" in tokenizer.decode(engine.prompts[1]) and "<think>" in tokenizer.decode(engine.prompts[1])
    assert session.segments[0].tokens[:len(engine.prompts[1])] == engine.prompts[1]
    assert session.segments[1].tokens[:len(engine.prompts[2])] == engine.prompts[2]
    assert "<think>" not in tokenizer.decode(engine.prompts[2]) and not any(session.segments[1].loss_mask[:len(engine.prompts[2])])
    # A completion from token ids: they are the segment's prompt as given.
    assert plain.choices[0].text == "Three." and session.segments[2].tokens[:3] == [5, 6, 7]
    assert session.segments[2].loss_mask[:3] == [0, 0, 0] and sum(session.segments[2].loss_mask) == plain.usage.completion_tokens


def test_the_requests_stop_strings_replace_the_actors_and_cut_the_text_and_the_kept_tokens():
    tokenizer = chatml_tokenizer()
    reply = "Act: look\nObservation: a cat<|im_end|>"

    async def scenario(gateway, root, engine):
        session = gateway.open("s3")
        llm = client(root, "s3")
        whole = await llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go."}])
        done = await llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go."}],
                                                 stop=["Observation:"])
        return session, whole, done

    session, whole, done = serve_gateway(tokenizer, [reply, reply], scenario)
    assert whole.choices[0].message.content == "Act: look\nObservation: a cat"  # not the actor's "\n"
    assert done.choices[0].message.content == "Act: look\n" and done.choices[0].finish_reason == "stop"
    kept = [t for t, m in zip(session.segments[-1].tokens, session.segments[-1].loss_mask) if m]
    assert tokenizer.decode(kept) == "Act: look\nObservation:"  # up to the token that completed the stop


def test_bad_requests_get_openais_errors_and_change_nothing():
    tokenizer = chatml_tokenizer()

    async def scenario(gateway, root, engine):
        session = gateway.open("s4")
        llm = client(root, "s4")
        errors = {}
        for name, call in {
            "no messages": llm.chat.completions.create(model="tiny", messages=[]),
            "n of 2": llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2),
            "too long": llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 300}]),
            "bad max": llm.completions.create(model="tiny", prompt="x", max_tokens=0),
            "token out of vocabulary": llm.completions.create(model="tiny", prompt=[1, 10**9]),
            "empty prompt": llm.completions.create(model="tiny", prompt=""),
            "unknown session": client(root, "nope").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}]),
        }.items():
            with pytest.raises(openai.APIStatusError) as caught:
                await call
            errors[name] = (caught.value.status_code, caught.value.body)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{root}/sessions/s4/v1/chat/completions", data=b"{not json") as r:
                errors["not json"] = (r.status, (await r.json())["error"])
            async with http.get(f"{root}/v1/chat/completions") as r:
                errors["no session"] = (r.status, (await r.json())["error"])
            async with http.post(f"{root}/sessions/s4/reward", json={"reward": "high"}) as r:
                errors["bad reward"] = (r.status, (await r.json())["error"])
            async with http.post(f"{root}/sessions/s4/reward", json={"reward": 1.5}) as r:
                assert r.status == 200
            async with http.post(f"{root}/sessions/s4/v1/completions", json={"prompt": "x"}) as r:
                errors["the engine failed"] = (r.status, (await r.json())["error"])
        return session, errors, engine

    session, errors, engine = serve_gateway(tokenizer, ["RAISE"], scenario, max_seq_len=256)
    assert errors.pop("the engine failed") == (500, {"message": "RuntimeError: the engine died",
                                                     "type": "server_error", "param": None, "code": None})
    for name, (status, body) in errors.items():
        assert 400 <= status < 500 and body["message"] and "Traceback" not in body["message"], (name, body)
    assert errors["no messages"][1]["param"] == "messages" and errors["n of 2"][1]["param"] == "n"
    assert errors["too long"][1]["code"] == "context_length_exceeded" and "actor.max_seq_len" in errors["too long"][1]["message"]
    assert errors["unknown session"][0] == 404 and errors["unknown session"][1]["code"] == "session_not_found"
    assert errors["no session"][0] in (404, 405) and "/sessions/KEY/v1" in errors["no session"][1]["message"]
    assert errors["bad max"][1]["param"] == "max_tokens" and errors["bad reward"][1]["param"] == "reward"
    assert errors["token out of vocabulary"][1]["param"] == "prompt" and errors["empty prompt"][1]["param"] == "prompt"
    assert len(engine.prompts) == 1 and session.rewards == [(0, 1.5)]  # no bad request reached the engine
    assert session.segments == [] and session.calls == 0  # nor the session: the failed call is not kept


def test_slow_clients_get_408_or_are_closed_and_hold_up_no_one(monkeypatch):
    """Slow clients (issue 30), as at the env server (common/http.py): a body that never ends
    gets 408 in OpenAI's error shape after BODY_TIMEOUT_S, a head that never ends is closed
    after KEEPALIVE_S, and a chat call is served beside them."""
    from common import http

    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(http, "KEEPALIVE_S", 1.0)
    tokenizer = chatml_tokenizer()

    async def scenario(gateway, root, engine):
        gateway.open("s5")
        port = int(root.rsplit(":", 1)[1])
        heads, bodies = [], []
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /sessions/s5/v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")  # and nothing more
            heads.append((reader, writer))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /sessions/s5/v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")  # 99 bytes short
            bodies.append((reader, writer))
        started = time.monotonic()
        reply = await client(root, "s5").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "fine" and time.monotonic() - started < 0.9  # beside them
        for reader, _ in bodies:
            answer = b""
            while not answer.endswith(b"}"):
                chunk = await asyncio.wait_for(reader.read(4096), 5)
                assert chunk, answer
                answer += chunk
            status, _, payload = answer.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 408"), status
            assert "did not arrive within 1s" in json.loads(payload)["error"]["message"]
        for reader, _ in heads:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
        for _, writer in heads + bodies:
            writer.close()

    serve_gateway(tokenizer, ["fine"], scenario)
