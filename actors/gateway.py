"""An OpenAI-compatible endpoint on the actor's engine, for agents written against the OpenAI
API: `/v1/models`, `/v1/chat/completions` (streaming, tool calls through the model's chat
template) and `/v1/completions`, under a session's base URL,
`http://HOST:PORT/sessions/KEY/v1`, which the official `openai` client takes as its `base_url`.

Every call of a session is captured token-exactly, as the episode loop captures its turns:
the prompt's tokens (rendered by the tokenizer's chat template and encoded once, or given as
token ids) with mask 0, the sampled tokens exactly as sampled with mask 1, their behaviour
log-probs and the weight version of each (the weight gate's, as in `ModelPolicy`). When a
call's prompt tokens extend the session's tokens so far (its last prompt and completion), the
call continues the same sequence; when they do not (a template that rewrites history, as
Qwen3's drops earlier reasoning, or an agent that edits or summarises its memory) the session
starts a new segment, trained with its own prompt. Nothing is re-tokenised from text.

The actor's sampling settings hold for every call (actor.temperature: the learner scores the
tokens at it); a request's `temperature`, `top_p` and `seed` are not applied, and `n` must be 1.
The request's stop strings replace the actor's (actor.stop is for its own env episodes).
Errors are OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`) with a 4xx status:
malformed JSON or fields, an unknown session, a prompt longer than actor.max_seq_len allows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from typing import Any

from aiohttp import web

from actors.chat import text_encoder
from actors.engine import Engine
from actors.episode import Policy, TokenBuffer
from common.http import read_body
from common.logs import first_line

log = logging.getLogger(__name__)

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)  # Hermes' format: Qwen2.5, Qwen3


class GatewayError(Exception):
    """An OpenAI error answer: status, message, and the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return web.json_response({"error": {"message": self.message, "type": kind, "param": self.param,
                                            "code": self.code}}, status=self.status)


@dataclasses.dataclass
class Session:
    """One agent run's calls: its token-exact segments, and what the metrics count."""

    key: str
    segments: list[TokenBuffer] = dataclasses.field(default_factory=list)
    segment_calls: list[int] = dataclasses.field(default_factory=list)  # the calls each segment holds
    texts: list[str] = dataclasses.field(default_factory=list)  # each call's completion, as decoded
    calls: int = 0
    extended: int = 0  # calls whose prompt extended the session's tokens: one sequence
    splits: int = 0  # calls whose prompt did not: a new segment
    rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """Those posted to .../reward, each with the count of calls made before it."""
    closed: bool = False
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, repr=False)
    running: set[asyncio.Task] = dataclasses.field(default_factory=set, repr=False)  # its calls' handlers

    def begin(self, prompt_ids: list[int]) -> None:
        """The context of the next call: the new tokens of a prompt that extends the current
        segment, or a new segment of the whole prompt."""
        self.calls += 1
        current = self.segments[-1] if self.segments else None
        if current is not None and prompt_ids[:len(current)] == current.tokens:
            current.add_context(prompt_ids[len(current):])
            self.extended += 1
            self.segment_calls[-1] += 1
            return
        if current is not None:
            self.splits += 1
        segment = TokenBuffer()
        segment.add_context(prompt_ids)
        self.segments.append(segment)
        self.segment_calls.append(1)


class Gateway:
    """The endpoint over `engine` (its tokenizer renders and encodes prompts), sampling through
    `policy` (an actor's ModelPolicy behind its weight gate; the evaluator's, pinned to the
    version it plays); `max_seq_len` bounds a prompt and its completion; `model` is the name
    /v1/models lists (requests may name any: one model is served)."""

    def __init__(self, engine: Engine, policy: Policy, max_seq_len: int, model: str):
        self.engine, self.tokenizer, self.max_seq_len, self.model = engine, engine.tokenizer, max_seq_len, model
        self.policy = policy
        self.encode = text_encoder(self.tokenizer)
        self.sessions: dict[str, Session] = {}

    def open(self, key: str | None = None) -> Session:
        key = key or uuid.uuid4().hex
        if key in self.sessions:
            raise ValueError(f"session {key!r} is open already")
        self.sessions[key] = session = Session(key)
        return session

    async def close(self, key: str) -> Session:
        """The session as its episode ended: a call still in flight (an agent that timed out, or
        returned without waiting for it) is cancelled, its generation with it, and not kept; later
        calls get a 404."""
        session = self.sessions.pop(key)
        session.closed = True
        for task in session.running:
            task.cancel()
        return session

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        app.add_routes([web.get("/v1/models", self.models), web.get("/sessions/{key}/v1/models", self.models),
                        web.post("/sessions/{key}/v1/chat/completions", self.chat),
                        web.post("/sessions/{key}/v1/completions", self.completions),
                        web.post("/sessions/{key}/reward", self.reward)])
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except GatewayError as exc:
            return exc.response()
        except web.HTTPException as exc:  # aiohttp's own: no route (404), wrong method (405)
            if exc.status < 400:
                raise
            hint = " (a session's base URL is http://HOST:PORT/sessions/KEY/v1)" if exc.status == 404 else ""
            return GatewayError(exc.status, f"{request.method} {request.path}: {exc.reason}{hint}").response()
        except Exception as exc:  # noqa: BLE001 - the engine's or ours: logged whole, answered in one line
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response({"error": {"message": f"{type(exc).__name__}: {first_line(exc)}",
                                                "type": "server_error", "param": None, "code": None}}, status=500)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "openmanus-rl"}]})

    async def reward(self, request: web.Request) -> web.Response:
        session, body = self._session(request), await self._json(request)
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise GatewayError(400, "reward must be a finite number", "reward")
        session.rewards.append((session.calls, float(value)))
        return web.json_response({"ok": True, "rewards": len(session.rewards)})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session, body = self._session(request), await self._json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise GatewayError(400, "messages must be a non-empty list of message objects", "messages")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise GatewayError(400, "tools must be a list", "tools")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise GatewayError(400, "stream_options must be an object", "stream_options")
        try:
            text = self.tokenizer.apply_chat_template(_for_template(messages), tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint, as a 400
            raise GatewayError(400, f"the model's chat template cannot render these messages: {exc}",
                               "messages") from None
        prompt = self.encode(text)
        ids, logprobs, finish, content = await self._generate(request, session, body, prompt, "max_completion_tokens",
                                                              "messages")
        calls = _tool_calls(content) if tools else []
        if calls:
            content, finish = content[:content.index("<tool_call>")].strip() or None, "tool_calls"
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": body.get("model") or self.model,
                  "choices": [{"index": 0, "message": message, "finish_reason": finish,
                               "logprobs": self._logprobs(ids, logprobs) if body.get("logprobs") else None}],
                  "usage": _usage(prompt, ids)}
        if body.get("stream"):
            return await self._stream_chat(request, answer, body)
        return web.json_response(answer)

    async def completions(self, request: web.Request) -> web.Response:
        session, body = self._session(request), await self._json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            prompt_ids = self.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < len(self.tokenizer) for t in prompt):
                raise GatewayError(400, f"prompt has token ids outside the vocabulary (0 to {len(self.tokenizer) - 1})",
                                   "prompt")
            prompt_ids = list(prompt)  # token ids as given: nothing encoded
        else:
            raise GatewayError(400, "prompt must be a non-empty string or list of token ids (one prompt: n = 1)",
                               "prompt")
        if body.get("stream"):
            raise GatewayError(400, "stream is not supported on /v1/completions; use /v1/chat/completions", "stream")
        ids, logprobs, finish, text = await self._generate(request, session, body, prompt_ids, "max_tokens", "prompt",
                                                           default_max=16)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": {
                "tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": logprobs}
                if body.get("logprobs") is not None else None}],
            "usage": _usage(prompt_ids, ids)})

    def _session(self, request: web.Request) -> Session:
        key = request.match_info["key"]
        session = self.sessions.get(key)
        if session is None:
            raise GatewayError(404, f"no open session {key!r}: the actor opens one per agent run and passes its "
                                    f"base URL", code="session_not_found")
        return session

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            raw = await read_body(request)
        except TimeoutError as exc:
            raise GatewayError(408, str(exc)) from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise GatewayError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        n = body.get("n")
        if n not in (None, 1):
            raise GatewayError(400, f"n = {n!r}: only n = 1 is served (a group's episodes are separate sessions)", "n")
        return body

    async def _generate(self, request: web.Request, session: Session, body: dict, prompt: list[int],
                        limit_field: str, prompt_field: str, default_max: int | None = None
                        ) -> tuple[list[int], list[float], str, str]:
        """Sample a completion of `prompt` through the weight gate and capture it in the session:
        its tokens, log-probs, finish reason and text. The request's stop strings replace the
        actor's (actor.stop, for its own episodes): the engine ends the tokens with the one that
        completes a stop string, and the text stops before it, as OpenAI answers. Nothing is
        captured of a call that fails or whose client left before its answer (a retry would
        otherwise train on a completion the agent never saw)."""
        room = self.max_seq_len - len(prompt)
        if room <= 0:
            raise GatewayError(400, f"the prompt is {len(prompt)} tokens; this endpoint serves at most "
                                    f"{self.max_seq_len} tokens of prompt and completion (actor.max_seq_len)",
                               prompt_field, "context_length_exceeded")
        field = limit_field if body.get(limit_field) is not None else "max_tokens"
        asked = body.get(field, default_max) if body.get(field) is not None else default_max
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise GatewayError(400, f"{field} must be a positive integer", field)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise GatewayError(400, "stop must be a non-empty string or a list of them", "stop")
        budget = min(room, asked) if asked is not None else room
        async with session.lock:  # a session's calls are captured in the order they run
            if session.closed:
                raise GatewayError(404, f"session {session.key!r} is closed", code="session_not_found")
            session.running.add(asyncio.current_task())
            try:
                turn = await self.policy.act(list(prompt), budget, 0, stops=stops)
            finally:
                session.running.discard(asyncio.current_task())
            ids, logprobs = list(turn.generation.token_ids), list(turn.generation.logprobs)
            if session.closed:
                raise GatewayError(404, f"session {session.key!r} closed during the call: not kept",
                                   code="session_not_found")
            if request.transport is None or request.transport.is_closing():
                log.warning("session %s: the client left before its answer; the call is not kept", session.key)
                raise GatewayError(499, "the client closed the connection")
            session.begin(prompt)
            session.segments[-1].add_generated(ids, logprobs, turn.version)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(stop) for stop in stops) if i >= 0]
            text = text[:min(cuts)] if cuts else text
            session.texts.append(text)
        finish = "length" if turn.generation.finish_reason == "length" else "stop"
        return ids, logprobs, finish, text

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict:
        pieces = [self.tokenizer.decode([t]) for t in ids]
        return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                            for p, lp in zip(pieces, logprobs)]}

    async def _stream_chat(self, request: web.Request, answer: dict, body: dict) -> web.StreamResponse:
        """The answer as server-sent events, as OpenAI streams one: a role chunk, the content, the
        tool calls, the finish reason (and usage when asked), then [DONE]. The engine hands the
        completion over whole, so the content comes in one chunk."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        choice = answer["choices"][0]
        message = choice["message"]
        head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

        async def send(delta: dict, finish: str | None = None, **extra) -> None:
            chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        if message["content"] or choice["logprobs"]:
            chunk = {**head, "choices": [{"index": 0, "delta": {"content": message["content"] or ""},
                                          "finish_reason": None, "logprobs": choice["logprobs"]}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        for i, call in enumerate(message.get("tool_calls", [])):
            await send({"tool_calls": [{"index": i, **call}]})
        await send({}, choice["finish_reason"])
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {**head, "choices": [], "usage": answer["usage"]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: a tool call's arguments as an object (OpenAI sends
    a JSON string), content parts of text joined into one string."""
    out = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part.get("text", "") for part in message["content"] if isinstance(part, dict))
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", {}))
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        raise GatewayError(400, "a tool call's arguments are not JSON", "messages") from None
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tool_calls(text: str) -> list[dict]:
    """The tool calls a completion makes in the Hermes format (`<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`, what Qwen's templates ask for), as OpenAI's tool_calls; none where one
    does not parse (the text then stays content, as the model wrote it)."""
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
            "name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    return calls


def _usage(prompt: list[int], ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
