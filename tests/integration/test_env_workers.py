"""`omrl env-server --workers 2` as a real process tree: two worker processes behind one
port, instances pinned to their worker, our client going straight to it, other clients
forwarded, a killed worker costing its own episodes only, a hung one killed and started again."""

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from broker.embedded import free_port
from common.retry import wait_http
from envs.client import EnvClient, EnvError


@pytest.fixture()
def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "envs", "--env", "letters", "--port", str(port), "--workers", "2",
                             "--set", "env.options.turns=3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 60, proc.poll)
        yield port, proc
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out


async def stats(session, port) -> dict:
    async with session.get(f"http://127.0.0.1:{port}/stats") as resp:
        return await resp.json()


async def episode(client: EnvClient, task: int) -> int:
    """One letters episode played right; the steps it took."""
    env_id = await client.create()
    obs = (await client.reset(env_id, task)).observation
    steps = 0
    while True:
        result = await client.step(env_id, obs[4])
        steps += 1
        if result.done:
            break
        obs = result.observation
    await client.close(env_id)
    return steps


def test_instances_live_in_their_worker_our_client_goes_straight_there_others_are_forwarded(server):
    port, _ = server

    async def main():
        async with aiohttp.ClientSession() as session:
            client = EnvClient(f"http://127.0.0.1:{port}", session)
            env_id = await client.create()
            # Worker i hands out ids equal to i modulo 2, and /create names its own port.
            assert client.endpoints[env_id] == f"http://127.0.0.1:{port + 1 + env_id % 2}"
            await client.close(env_id)
            assert not client.endpoints  # forgotten with the env
            steps = sum(await asyncio.gather(*[episode(client, task) for task in range(12)]))
            assert steps == 12 * 3 and client.direct

        # A client that ignores `endpoint`, one connection a request: the kernel spreads them over
        # both workers, and each request for the other worker's env is forwarded to it.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as plain:
            base = f"http://127.0.0.1:{port}"
            ids = []
            for _ in range(16):
                async with plain.post(f"{base}/create", json={}) as resp:
                    ids.append((await resp.json())["id"])
            assert {i % 2 for i in ids} == {0, 1}
            for env_id in ids:
                for _ in range(3):
                    async with plain.post(f"{base}/reset", json={"id": env_id, "data_idx": 1}) as resp:
                        assert resp.status == 200 and (await resp.json())["id"] == env_id
            async with plain.post(f"{base}/step", data=b"{not json") as resp:
                assert resp.status == 400 and "not JSON" in (await resp.json())["error"]
            async with plain.post(f"{base}/step", json={"id": ids[0] + 2 * 10**6, "action": "a"}) as resp:
                assert resp.status == 404
            counts = await stats(plain, port)
            assert counts["created"] == 1 + 12 + 16 and counts["steps"] == 36 and counts["open"] == 16
            assert [w["worker"] for w in counts["workers"]] == [0, 1] and all(w["up"] for w in counts["workers"])
            assert sum(w["created"] for w in counts["workers"]) == counts["created"]

    asyncio.run(main())


def test_an_endpoint_out_of_reach_sends_the_client_through_the_shared_port(server):
    port, _ = server

    async def main():
        async with aiohttp.ClientSession() as session:
            client = EnvClient(f"http://127.0.0.1:{port}", session)
            env_id = await client.create()
            client.endpoints[env_id] = f"http://127.0.0.1:{free_port()}"  # as a port not published from a container
            assert (await client.reset(env_id, 2)).observation.startswith("Say ")
            assert not client.direct and not client.endpoints
            assert await episode(client, 5) == 3 and not client.endpoints

    asyncio.run(main())


def test_a_killed_worker_costs_its_own_episodes_and_comes_back(server):
    port, proc = server

    async def main():
        async with aiohttp.ClientSession() as session:
            client = EnvClient(f"http://127.0.0.1:{port}", session)
            ids = [await client.create() for _ in range(8)]
            assert sorted(i % 2 for i in ids) == [0] * 4 + [1] * 4  # to the least loaded, wherever they land
            for env_id in ids:
                await client.reset(env_id, 1)
            for env_id in [i for i in ids if i % 2][:2]:  # worker 1 now the least loaded
                await client.close(env_id)
                ids.remove(env_id)
            killed = (await stats(session, port))["workers"][1]["pid"]
            os.kill(killed, signal.SIGKILL)
            await asyncio.sleep(0.05)
            assert (await client.create()) % 2 == 0  # the least loaded is down: worker 0 creates
            outcomes = await asyncio.gather(*[client.step(i, "a") for i in ids], return_exceptions=True)
            lost = [i for i, out in zip(ids, outcomes) if isinstance(out, EnvError)]
            kept = [i for i, out in zip(ids, outcomes) if not isinstance(out, BaseException)]
            assert sorted(lost + kept) == sorted(ids)  # every request answered: an error or a result
            assert {i % 2 for i in lost} == {1} and {i % 2 for i in kept} == {0}
            deadline = time.monotonic() + 60  # the parent starts it again (a process start: slow on a busy machine)
            while time.monotonic() < deadline:
                workers = (await stats(session, port))["workers"]
                if workers[1]["up"] and workers[1]["pid"] != killed:
                    break
                await asyncio.sleep(0.1)
            assert workers[1]["up"] and workers[1]["open"] == 0 and proc.poll() is None
            with pytest.raises(EnvError, match="404"):
                await client.step(lost[0], "a")
            assert await episode(client, 4) == 3

    asyncio.run(main())


def test_workers_below_one_fail_at_start_naming_the_field():
    done = subprocess.run([sys.executable, "-m", "envs", "--env", "letters", "--workers", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "env.workers" in done.stderr + done.stdout


@pytest.mark.parametrize("seed", [0, 1])
def test_a_hung_worker_is_killed_and_started_again_within_hang_s(seed):
    """Worker 1 SIGSTOPped at a random moment (seed printed): its beats stop, and the parent
    kills it supervisor.hang_s (here 2 s) after its last and starts it again; worker 0 serves
    on, and so does the whole server afterwards."""
    rng = random.Random(seed)
    print(f"seed {seed}")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "envs", "--env", "letters", "--port", str(port), "--workers", "2",
                             "--set", "env.options.turns=3", "--set", "supervisor.hang_s=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    async def main():
        async with aiohttp.ClientSession() as session:
            client = EnvClient(f"http://127.0.0.1:{port}", session)
            await asyncio.sleep(rng.uniform(0.5, 3.0))  # beating: left alone
            workers = (await stats(session, port))["workers"]
            assert all(w["up"] for w in workers), workers
            stopped, own = workers[1]["pid"], workers[0]["port"]
            os.kill(stopped, signal.SIGSTOP)
            at, created = time.monotonic(), []
            # Through worker 0's own port meanwhile: a connection the kernel hands the stopped worker on
            # the shared port waits in its queue until the kill resets it (SO_REUSEPORT; envs/workers.py).
            worker0 = EnvClient(f"http://127.0.0.1:{own}", session)
            while time.monotonic() - at < 20:
                worker = (await stats(session, own))["workers"][1]
                if worker["up"] and worker["pid"] != stopped:
                    break
                created.append(await worker0.create())  # worker 0 serves on
            back = time.monotonic() - at
            assert worker["up"] and worker["pid"] != stopped, worker
            assert created and created[0] % 2 == 0, created
            assert 1.0 <= back < 12, back  # 2 s after its last beat (up to 1 s before the stop), plus its start
            assert [await episode(client, task) for task in range(4)] == [3] * 4
            return stopped

    try:
        wait_http(f"http://127.0.0.1:{port}/", 60, proc.poll)
        stopped = asyncio.run(main())
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "env worker 1 made no progress for" in out and "supervisor.hang_s = 2" in out, out
    assert not os.path.exists(f"/proc/{stopped}")
