"""A ReAct agent in plain `openai` client code, with one tool: the environment.

It is what you would write to run an agent against any OpenAI-compatible server; OpenManus-RL
trains it by calling `rollout(task, client)` once an episode, with `client` pointed at the
actor's endpoint (a session of its own), and training on exactly the tokens its calls sampled.

The env is a tool the model calls (`act`), reached over HTTP in the AgentGym protocol
(`/create`, `/reset`, `/step`, `/close` at `task["env_url"]`): any built-in env of
`omrl env-server` works. A model that answers in text instead of calling the tool (a small
one that has never seen tools) has its text sent as the action: the ReAct loop stays the same.

    actor.agent = "examples/own-agent/agent.py:rollout"        # a real model: tool calls, 512 tokens a turn
    actor.agent = "examples/own-agent/agent.py:rollout_tiny"   # the tiny model: one line a turn
"""

from __future__ import annotations

import json

import aiohttp
import openai

SYSTEM = "Solve the task. Call the tool `act` with your next action; the environment answers with what follows."
TOOLS = [{"type": "function", "function": {
    "name": "act", "description": "Send one action to the environment and get its observation back.",
    "parameters": {"type": "object", "properties": {"action": {"type": "string"}}, "required": ["action"]}}}]


async def rollout(task: dict, client) -> float:
    """One episode of `task` on a model that calls tools; returns the env's total reward."""
    return await react(task, client, system=SYSTEM, max_tokens=512, stop=None, max_turns=8)


async def rollout_tiny(task: dict, client) -> float:
    """The same agent for the tiny model of `omrl init-model`: no system text, a line a turn."""
    return await react(task, client, system=None, max_tokens=4, stop=["\n"], max_turns=4)


async def react(task: dict, client, system: str | None, max_tokens: int, stop: list[str] | None,
                max_turns: int) -> float:
    async with aiohttp.ClientSession(base_url=task["env_url"].rstrip("/") + "/") as env:
        env_id = (await _call(env, "create", {}))["id"]
        try:
            first = await _call(env, "reset", {"id": env_id, "data_idx": task["task_id"]})
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": first["observation"]}]
            total = 0.0
            for _ in range(max_turns):
                try:
                    reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                                 max_tokens=max_tokens, stop=stop)
                except openai.BadRequestError as exc:
                    if exc.code == "context_length_exceeded":  # the conversation is full: the episode ends here
                        break
                    raise
                message = reply.choices[0].message
                calls = message.tool_calls or []
                messages.append({"role": "assistant", "content": message.content or "",
                                 **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
                # The tool's action, or the text itself from a model that answers in text.
                action = _action(calls[0].function.arguments) if calls else message.content or ""
                step = await _call(env, "step", {"id": env_id, "action": action})
                total += float(step["reward"])
                if step["done"]:
                    break
                if calls:
                    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": step["observation"]})
                else:
                    messages.append({"role": "user", "content": step["observation"]})
            return total
        finally:
            await _call(env, "close", {"id": env_id})


def _action(arguments: str) -> str:
    """The tool call's action; arguments that are not the object asked for are the action as written."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return str(parsed.get("action", "")) if isinstance(parsed, dict) else arguments


async def _call(env: aiohttp.ClientSession, route: str, body: dict) -> dict:
    async with env.post(route, json=body) as response:
        response.raise_for_status()
        return await response.json()
