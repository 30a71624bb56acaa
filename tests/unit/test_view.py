"""`omrl view`'s server (deploy/commands/view.py) over real HTTP: the page, the list of kept episodes
as the run's files hold them at each request (a live run's new ones, the rotated file), one
episode whole, and a 404 JSON error for an unknown one. The page itself in a browser:
tests/e2e/test_omrl_run.py."""

import asyncio
import json
import subprocess
import sys

from aiohttp.test_utils import TestClient, TestServer

from deploy.commands.view import app


def episode(step: int, j: int, reward: float) -> dict:
    return {"id": f"{step}-{j}", "step": step, "weight_version": step, "why": "best", "group_id": "g", "actor_id": "a",
            "task_id": "7", "env_name": "letters", "reward": reward, "success": reward == 1.0, "turn_rewards": [reward],
            "finish_reason": "done", "invalid_actions": 0, "staleness": 1, "group_rewards": [reward],
            "turns": [{"role": "prompt", "text": "Say <b>", "tokens": [1], "pieces": ["Say <b>"]}]}


def test_the_server_reads_the_runs_files_at_every_request(tmp_path):
    async def scenario():
        async with TestClient(TestServer(app(tmp_path))) as client:
            page = await client.get("/")
            assert page.status == 200 and "<title>omrl view</title>" in await page.text()
            assert (await (await client.get("/api/episodes")).json())["episodes"] == []  # none kept yet

            (tmp_path / "samples.1.jsonl").write_text(json.dumps(episode(10, 0, 0.5)) + "\n")
            with open(tmp_path / "samples.jsonl", "w") as f:
                f.write(json.dumps(episode(20, 0, 1.0)) + "\n" + '{"id": "30-0", "st')  # the learner mid-line
            rows = (await (await client.get("/api/episodes")).json())["episodes"]
            assert [(r["id"], r["reward"], r["turns"]) for r in rows] == [("10-0", 0.5, 1), ("20-0", 1.0, 1)]
            assert "pieces" not in rows[0]  # the list is a summary; an episode comes whole on its own

            whole = await (await client.get("/api/episodes/20-0")).json()
            assert whole == episode(20, 0, 1.0)
            missing = await client.get("/api/episodes/99-9")
            assert missing.status == 404 and "no kept episode '99-9'" in (await missing.json())["error"]

    asyncio.run(scenario())


def test_a_bad_run_dir_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "view", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is not a directory" in done.stderr and "Traceback" not in done.stderr
