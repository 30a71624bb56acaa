"""The agent of agent.py as an HTTP service: what `actor.agent_url` points at, for agents that
live in another process, container or language.

For each episode the actor POSTs {"task": {...}, "base_url": ".../sessions/KEY/v1", "session": KEY}
to /rollout; the service runs the agent with an OpenAI client on that base URL and answers
{"reward": R}. Any 4xx/5xx answer (or none within actor.agent_timeout_s) fails the episode's group.

    python examples/own-agent/service.py --port 8300 [--tiny]
    omrl run --config examples/own-agent/run.toml --set 'actor.agent=""' --set 'actor.agent_url="http://127.0.0.1:8300/rollout"'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiohttp import web
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).parent))
from agent import rollout, rollout_tiny  # noqa: E402 - beside this file


def app(tiny: bool) -> web.Application:
    agent = rollout_tiny if tiny else rollout

    async def play(request: web.Request) -> web.Response:
        body = await request.json()
        client = AsyncOpenAI(base_url=body["base_url"], api_key="unused")
        try:
            return web.json_response({"reward": await agent(body["task"], client)})
        finally:
            await client.close()

    application = web.Application()
    application.add_routes([web.post("/rollout", play), web.get("/", lambda _: web.json_response("ok"))])
    return application


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--tiny", action="store_true", help="the tiny model's agent (a line a turn)")
    args = parser.parse_args()
    web.run_app(app(args.tiny), host=args.host, port=args.port, print=None)
