"""The env server and the async client over real HTTP on a loopback port."""

import asyncio

import aiohttp
import pytest

from broker.embedded import free_port
from envs.client import EnvClient, EnvError
from envs.server import EnvServer, serve


def with_server(scenario, **server_kw):
    async def main():
        port = free_port()
        server = EnvServer("letters", {"turns": 2, "alphabet": "ab"}, **server_kw)
        runner = await serve(server, "127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(EnvClient(f"http://127.0.0.1:{port}", session), session, port, server)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_full_episode_over_http():
    async def scenario(client, session, port, server):
        assert "letters" in await client.health()
        env_id = await client.create()
        obs = await client.reset(env_id, 3)
        assert obs.startswith("Say ")
        assert await client.observation(env_id) == obs
        target = obs[4]
        first = await client.step(env_id, target + "\n")
        assert first.reward == pytest.approx(0.5) and not first.done
        second = await client.step(env_id, "zz")
        assert second.reward == 0.0 and second.done
        assert await client.close(env_id) is True
        assert server.stats["created"] == 1 and server.stats["closed"] == 1 and not server.envs
    with_server(scenario)


def test_each_client_gets_its_own_env():
    async def scenario(client, session, port, server):
        ids = await asyncio.gather(*[client.create() for _ in range(20)])
        assert len(set(ids)) == 20
    with_server(scenario)


def test_bad_requests_get_4xx_json_errors():
    async def scenario(client, session, port, server):
        base = f"http://127.0.0.1:{port}"
        cases = [
            ("/reset", b"{not json", 400, "not JSON"),
            ("/reset", b'{"id": "x", "data_idx": 1}', 400, "'id' must be an integer"),
            ("/step", b'{"id": 12345, "action": "a"}', 404, "no env with id 12345"),
        ]
        for path, body, status, message in cases:
            async with session.post(base + path, data=body, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == status
                assert message in (await resp.json())["error"]
        env_id = await client.create()
        with pytest.raises(EnvError, match="step before reset"):
            await client.step(env_id, "a")
        async with session.get(base + "/observation", params={"id": "abc"}) as resp:
            assert resp.status == 400
    with_server(scenario)


def test_abandoned_envs_are_freed():
    async def scenario(client, session, port, server):
        await client.create()
        await asyncio.sleep(0.3)
        assert server.stats["reaped"] == 1 and not server.envs
    with_server(scenario, idle_ttl_s=0.1)
