"""The env server and the async client over real HTTP on a loopback port."""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from broker.embedded import free_port
from envs.base import StepResult, register_env
from envs.builtin import LettersEnv
from envs.client import EnvClient, EnvError, EnvTimeout, EnvUnreachable
from envs.server import EnvServer, serve


def with_server(scenario, env="letters", **server_kw):
    async def main():
        port = free_port()
        server = EnvServer(env, {"turns": 2, "alphabet": "ab"}, **server_kw)
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
        obs = (await client.reset(env_id, 3)).observation
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


def with_scripted_server(scenario, handlers):
    """A bare aiohttp server whose handlers misbehave on purpose; counts requests by path."""
    async def main():
        port = free_port()
        seen: dict[str, int] = {}

        def counted(handler):
            async def wrapped(request):
                seen[request.path] = seen.get(request.path, 0) + 1
                return await handler(request, seen[request.path])
            return wrapped

        app = web.Application()
        for path, handler in handlers.items():
            app.router.add_route("*", path, counted(handler))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                await scenario(EnvClient(f"http://127.0.0.1:{port}", session, timeout_s=0.5), seen)
        finally:
            await runner.cleanup()
    asyncio.run(main())


async def slow(request, n):
    await asyncio.sleep(2)
    return web.json_response({})


async def slow_once(request, n):
    if n == 1:
        await asyncio.sleep(2)
    return web.json_response({"observation": "Say a", "reward": 0, "done": False, "id": 1})


async def answer_lost(request, n):
    request.transport.close()  # the request arrived; its answer never leaves
    return web.json_response({})


def test_a_step_or_create_whose_answer_was_lost_is_not_sent_again():
    async def scenario(client, seen):
        with pytest.raises(EnvTimeout):
            await client.step(1, "a")
        with pytest.raises(EnvUnreachable) as exc:
            await client.create()
        assert exc.value.reason == "env_unreachable"
        assert seen == {"/step": 1, "/create": 1}  # neither was retried: the server may have acted
        assert (await client.reset(1, 0)).observation == "Say a"  # idempotent: retried after the timeout
        assert seen["/reset"] == 2
    with_scripted_server(scenario, {"/step": slow, "/create": answer_lost, "/reset": slow_once})


def test_a_server_that_is_down_is_retried_for_every_request_until_it_answers():
    """Connection refused means nothing was sent: even /create is retried (5 attempts over
    about 3 s), so a server restarting in that time costs nothing."""
    async def main():
        port = free_port()

        async def late_server():
            await asyncio.sleep(0.7)
            return await serve(EnvServer("letters"), "127.0.0.1", port)

        async with aiohttp.ClientSession() as session:
            client = EnvClient(f"http://127.0.0.1:{port}", session)
            starting = asyncio.create_task(late_server())
            env_id = await client.create()
            runner = await starting
            assert isinstance(env_id, int)
            await runner.cleanup()
            with pytest.raises(EnvUnreachable):
                await client.health()  # down for good: the last attempt's error is raised
    asyncio.run(main())


def test_answers_that_are_not_json_are_env_errors():
    async def html(request, n):
        return web.Response(text="<html>502 Bad Gateway</html>", status=502, content_type="text/html")

    async def scenario(client, seen):
        with pytest.raises(EnvError, match="HTTP 502: the answer is not JSON"):
            await client.step(1, "a")
    with_scripted_server(scenario, {"/step": html})


@register_env("slow_or_crashing_test")
class SlowOrCrashing(LettersEnv):
    """`letters`, except that task 0 blocks for a second in every step (a JVM call, say) and
    task 1 crashes in its first step."""

    blocking = True  # it blocks: its calls must run in threads

    def reset(self, task_idx: int) -> str:
        self.task_idx = task_idx
        return super().reset(task_idx)

    def step(self, action: str) -> StepResult:
        if self.task_idx == 0:
            time.sleep(1.0)
        if self.task_idx == 1:
            raise ValueError("the simulator fell over")
        return super().step(action)


def test_a_blocking_env_does_not_stall_the_others_and_a_crash_costs_one_instance():
    async def scenario(client, session, port, server):
        slow, crashing, fine = [await client.create() for _ in range(3)]
        for env_id, task in ((slow, 0), (crashing, 1), (fine, 2)):
            await client.reset(env_id, task)
        slow_step = asyncio.create_task(client.step(slow, "a"))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await client.step(fine, "a")  # answered while the slow one blocks its worker thread
        fast = time.monotonic() - started
        with pytest.raises(EnvError, match="HTTP 500: env .* crashed in step: ValueError: the simulator fell over"):
            await client.step(crashing, "a")
        with pytest.raises(EnvError, match="HTTP 404"):
            await client.step(crashing, "a")  # the crashed instance was freed
        await slow_step
        assert fast < 0.5
        counts = await client.health()
        assert "2 open" in counts and "3 created" in counts and "1 failed" in counts
        async with session.get(f"http://127.0.0.1:{port}/stats") as resp:
            stats = await resp.json()
        assert (stats["open"], stats["created"], stats["failed"]) == (2, 3, 1)
    with_server(scenario, env="slow_or_crashing_test")


def test_past_the_cap_create_answers_503_with_retry_after():
    async def scenario(client, session, port, server):
        await client.create()
        await client.create()
        async with session.post(f"http://127.0.0.1:{port}/create", json={}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert "the limit is 2" in (await resp.json())["error"]
    with_server(scenario, max_envs=2)


def test_oracle_random_and_mistake_actions_over_http():
    """Given while an episode is under way; before its reset and after its end they are refused
    (409), the instance kept (the fuzz test found the oracle crashing there, which freed it)."""
    async def scenario(client, session, port, server):
        env_id = await client.create()
        with pytest.raises(EnvError, match="409.*no episode under way"):
            await client.oracle_action(env_id)
        obs = (await client.reset(env_id, 7)).observation
        assert await client.oracle_action(env_id) == obs[-1]
        assert await client.random_action(env_id) in "ab"
        assert await client.mistake_action(env_id) in "ab"  # an env without its own mistake: a random action
        result = await client.step(env_id, await client.oracle_action(env_id))
        assert result.reward == pytest.approx(0.5) and "success" in result.info
        assert (await client.step(env_id, await client.oracle_action(env_id))).done
        for action in (client.oracle_action, client.random_action, client.mistake_action):
            with pytest.raises(EnvError, match="409.*no episode under way"):
                await action(env_id)
        assert env_id in server.instances and server.stats["failed"] == 0
        await client.reset(env_id, 8)  # the next episode of the same instance
        assert await client.oracle_action(env_id)

        # An oracle call that waits for the instance while a step ends the episode is refused
        # too: the check is made under the instance's lock (it was made before, and the oracle
        # then crashed on the finished env).
        await client.step(env_id, await client.oracle_action(env_id))
        env, server.inline = server.instances[env_id].env, False  # calls in a worker thread
        step = env.step
        env.step = lambda action: (time.sleep(0.3), step(action))[1]
        last = asyncio.create_task(client.step(env_id, await client.oracle_action(env_id)))
        await asyncio.sleep(0.1)  # the step holds the instance
        with pytest.raises(EnvError, match="409.*no episode under way"):
            await client.oracle_action(env_id)
        assert (await last).done and env_id in server.instances and server.stats["failed"] == 0
    with_server(scenario)


def test_an_instance_left_in_order_is_reset_for_the_next_episode_and_one_gone_is_replaced():
    async def scenario(client, session, port, server):
        env_id, first = await client.start(3)
        assert first.observation.startswith("Say ") and server.stats["created"] == 1
        await client.finish(env_id, in_order=True)  # kept, not closed
        again, _ = await client.start(4)
        assert again == env_id and server.stats["created"] == 1 and server.stats["closed"] == 0
        await client.finish(again, in_order=False)  # an episode that failed: its instance is closed
        assert server.stats["closed"] == 1 and not server.envs

        kept, _ = await client.start(5)
        await client.finish(kept, in_order=True)
        await client.close(kept)  # gone behind the kept list's back (as when reaped after idling)
        client.kept.append(kept)
        fresh, answer = await client.start(6)
        assert fresh != kept and answer.observation.startswith("Say ") and server.stats["created"] == 3
        await client.finish(fresh, in_order=True)
        await client.close_kept()
        assert not client.kept and not server.envs

        client.reuse = False  # env.reuse_instances = false: every episode its own instance
        one, _ = await client.start(7)
        await client.finish(one, in_order=True)
        assert not client.kept and not server.envs and server.stats["created"] == 4
    with_server(scenario)


def test_slow_clients_are_cut_off_and_hold_up_no_one(monkeypatch):
    """Slow clients (issue 30): a request head that never ends is closed once the connection's
    keep-alive time passes; a body that never ends gets 408 in JSON after BODY_TIMEOUT_S; others
    are served at once meanwhile."""
    from common import http

    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(http, "KEEPALIVE_S", 1.0)

    async def scenario(client, session, port, server):
        heads, bodies = [], []
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /create HTTP/1.1\r\nHost: envs\r\n")  # and nothing more
            heads.append((reader, writer))
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /create HTTP/1.1\r\nHost: envs\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # 99 bytes short, for good
            bodies.append((reader, writer))
        started = time.monotonic()
        env_id = await client.create()
        await client.reset(env_id, 0)
        assert time.monotonic() - started < 0.5  # served beside them
        for reader, _ in bodies:
            answer = b""
            while b"}" not in answer:
                chunk = await asyncio.wait_for(reader.read(4096), 5)
                assert chunk, answer
                answer += chunk
            status, _, payload = answer.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 408") and "did not arrive within 1s" in json.loads(payload)["error"]
        for reader, _ in heads:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
        assert time.monotonic() - started < 5
        for _, writer in heads + bodies:
            writer.close()
        assert list(server.instances) == [env_id] and "1 created" in await client.health()
    with_server(scenario)
