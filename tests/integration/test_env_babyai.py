"""BabyAI served by `omrl env-server`: the answers of AgentGym's own server, replayed; the
oracle through our client and `omrl eval`; the refusals AgentGym's server gives."""

import gzip
import json
from pathlib import Path

import pytest

from tests.servers import env_server_process, http_json, oracle_eval, post_ok

pytest.importorskip("minigrid", reason="the babyai extra is not installed (pip install openmanus-rl[babyai])")
pytestmark = pytest.mark.babyai

RECORDED = Path(__file__).parent.parent / "data" / "babyai_agentgym_episodes.json.gz"


@pytest.fixture(scope="module")
def server():
    with env_server_process("babyai") as url:
        yield url


def test_replays_agentgym_servers_answers_exactly(server):
    """40 episodes (one per level, oracle, random and refused actions) recorded from
    AgentGym's babyai server: every observation, reward, score and done flag agrees."""
    recorded = json.loads(gzip.open(RECORDED, "rt").read())
    steps = 0
    for episode in recorded["episodes"]:
        env_id = post_ok(server, "/create", {})["id"]
        got = post_ok(server, "/reset", {"id": env_id, "data_idx": episode["data_idx"]})
        for field in ("observation", "reward", "score", "done"):
            assert got[field] == episode["reset"][field], (episode["data_idx"], field)
        for t, want in enumerate(episode["steps"]):
            got = post_ok(server, "/step", {"id": env_id, "action": want["action"]})
            for field in ("observation", "reward", "score", "done"):
                assert got[field] == want[field], (episode["data_idx"], t, want["action"], field)
            steps += 1
        post_ok(server, "/close", {"id": env_id})
    assert steps > 300 and sum(e["steps"][-1]["done"] for e in recorded["episodes"]) >= 20


def test_refusals_name_the_instance(server):
    env_id = post_ok(server, "/create", {})["id"]
    first = post_ok(server, "/reset", {"id": env_id, "data_idx": 0})["observation"]
    assert first.startswith("Your goal: go to the red ball\n") and '"turn left"' in first
    done, observation = False, first
    for _ in range(20):
        action = http_json("GET", f"{server}/oracle?id={env_id}")[1]["action"]
        actions = http_json("GET", f"{server}/actions?id={env_id}")[1]["actions"]  # actor.constrain_actions'
        assert action in actions and all(f'"{a}"' in observation for a in actions), (action, actions)
        answer = post_ok(server, "/step", {"id": env_id, "action": action})
        observation = answer["observation"]
        if answer["done"]:
            done = True
            break
    assert done and answer["observation"].count("The task is completed.") == 1
    status, refused = http_json("POST", server + "/step", {"id": env_id, "action": "turn left"})
    assert status == 409 and refused["error"] == f"The task with environment {env_id} has finished."
    status, unknown = http_json("POST", server + "/step", {"id": 10 ** 9, "action": "turn left"})
    assert status == 404 and "error" in unknown


def test_oracle_solves_held_out_tasks_through_our_client(server):
    result = oracle_eval("babyai", server, 20, "actor.max_turns=64", "actor.max_seq_len=100000")
    assert result["episodes"] == 20 and result["success"] >= 0.9, result
    stats = http_json("GET", server + "/stats")[1]
    assert stats["failed"] == 0
