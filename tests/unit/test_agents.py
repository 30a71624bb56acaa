"""Loading your agent by file path as an import would, and the rewards an agent may answer
(actors/agents.py); the actor loop with agents is tests/integration/test_agents.py."""

import pytest

from actors.agents import AgentError, AgentRollouts, import_named, load_agent
from actors.gateway import Session
from common.config import ActorConfig


def test_an_agent_file_imports_as_a_module_its_dataclasses_and_its_neighbours_work(tmp_path):
    (tmp_path / "helpers.py").write_text("TOOL = 'act'\n")
    (tmp_path / "my_agent.py").write_text(
        "from __future__ import annotations\n\nimport dataclasses\n\nfrom helpers import TOOL\n\n\n"
        "@dataclasses.dataclass\nclass Memory:\n    turns: list[str]\n\n\n"
        "async def rollout(task, client):\n    return float(len(Memory([TOOL]).turns))\n")
    module = import_named(str(tmp_path / "my_agent.py"))
    assert module.Memory(["a"]).turns == ["a"] and module.TOOL == "act"
    assert load_agent(ActorConfig(agent=f"{tmp_path}/my_agent.py:rollout"))
    (tmp_path / "broken.py").write_text("def rollout(:\n")
    for name, says in ((f"{tmp_path}/broken.py:rollout", "SyntaxError"), (f"{tmp_path}/my_agent.py:Memory",
                                                                          "is not an async function"),
                       (f"{tmp_path}/missing.py:rollout", "no file")):
        with pytest.raises(ValueError, match=says) as raised:
            load_agent(ActorConfig(agent=name))
        assert "actor.agent" in str(raised.value)


@pytest.mark.parametrize("answer, posted, reward, success", [
    (0.5, [], 0.5, None), ({"reward": 1, "success": True}, [], 1.0, True), (None, [(0, 0.25), (1, 0.5)], 0.75, None),
    ({"reward": None, "success": False}, [(1, 0.5)], 0.5, False)])
def test_the_reward_is_returned_or_the_sum_of_the_posted_ones(answer, posted, reward, success):
    session = Session("s", rewards=list(posted))
    assert AgentRollouts._reward(answer, session, 3) == (reward, success)


@pytest.mark.parametrize("answer, reason", [
    (None, "agent_no_reward"), ({"reward": None}, "agent_no_reward"), ("1.0", "agent_error"), (True, "agent_error"),
    (float("nan"), "agent_error"), (10 ** 400, "agent_error"), ({"reward": 1.0, "success": "yes"}, "agent_error")])
def test_a_reward_that_is_not_a_finite_number_fails_the_episode_with_the_reason(answer, reason):
    with pytest.raises(AgentError) as raised:
        AgentRollouts._reward(answer, Session("s"), 3)
    assert raised.value.reason == reason
