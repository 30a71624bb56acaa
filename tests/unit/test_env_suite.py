"""The suite of small envs that need their observations: each is deterministic per task,
keeps rewards in [0, 1], has an oracle that solves it and a random policy well below it,
refuses steps after the end, and cannot be solved without reading the feedback: the best
of many observation-blind action sequences does clearly worse than the oracle."""

import random

import pytest

from envs.base import make_env

SUITE = ["guess_number", "grid_nav", "calculator", "word_guess"]


def play(name: str, choose, tasks: range, **options) -> tuple[float, float]:
    """Mean reward and success rate of a policy `choose(env, turn)` over `tasks`."""
    total = wins = 0.0
    for task in tasks:
        env = make_env(name, **options)
        env.reset(task)
        done, turn, reward, info = False, 0, 0.0, {}
        while not done:
            result = env.step(choose(env, turn))
            assert 0.0 <= result.reward <= 1.0
            reward += result.reward
            done, info, turn = result.done, result.info, turn + 1
        assert 0.0 <= reward <= 1.0 + 1e-9
        total, wins = total + reward, wins + bool(info.get("success"))
    return total / len(tasks), wins / len(tasks)


@pytest.mark.parametrize("name", SUITE)
def test_tasks_are_deterministic_and_differ(name):
    def transcript(task: int) -> list[str]:
        env = make_env(name)
        seen, done = [env.reset(task)], False
        while not done:
            action = env.oracle_action()
            result = env.step(action)
            seen += [action, result.observation]
            done = result.done
        return seen
    first = [transcript(t) for t in range(50)]
    assert first == [transcript(t) for t in range(50)]
    assert len({tuple(t) for t in first}) > 5


@pytest.mark.parametrize("name", SUITE)
def test_oracle_solves_random_does_not_and_feedback_is_needed(name):
    tasks = range(300)
    oracle_reward, oracle_success = play(name, lambda env, turn: env.oracle_action(), tasks)
    rng = random.Random(0)
    random_reward, random_success = play(name, lambda env, turn: env.random_action(rng), tasks)
    assert oracle_success >= 0.95
    assert random_reward < oracle_reward - 0.25 and random_success < oracle_success - 0.4
    # Observation-blind: one fixed sequence of actions, replayed on every task; the best of 30.
    draw = random.Random(1)
    blind = []
    for _ in range(30):
        probe = make_env(name)
        probe.reset(0)
        sequence = [probe.random_action(draw) for _ in range(12)]
        blind.append(play(name, lambda env, turn, seq=sequence: seq[turn], tasks)[1])
    assert max(blind) < oracle_success - 0.4, (name, max(blind))


@pytest.mark.parametrize("name", SUITE)
def test_a_step_after_the_end_is_refused(name):
    env = make_env(name)
    env.reset(3)
    done = False
    while not done:
        done = env.step(env.oracle_action()).done
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("x")


def test_feedback_texts():
    env = make_env("guess_number")
    assert env.reset(0) == "1-8?"
    secret = env.secret
    low = env.step(str(secret - 1)) if secret > 1 else env.step(str(secret + 1))
    assert low.observation in "<>" and low.reward == 0 and not low.done
    grid = make_env("grid_nav", size=3, walls=0)
    obs = grid.reset(5)
    assert obs[0] in "ew" and obs[2] in "ns"
    calc = make_env("calculator")
    assert calc.reset(1).endswith("=")
    call = calc.step("c?")  # read by its start
    assert call.observation == calc.answer and call.reward == pytest.approx(0.2)
    assert calc.step("c").reward == 0  # the call earns once
    answer = calc.step(calc.answer + "x")
    assert answer.done and answer.info["success"] and answer.reward == pytest.approx(0.8)
    word = make_env("word_guess")
    assert word.reset(2) == ".."
    assert set(word.step("zz").observation) == {"-"}
    half = word.secret[0] + ("z" if word.secret[1] != "z" else "y")
    first = word.step(half)
    assert first.observation == "=-" and first.reward == pytest.approx(0.25)
    assert word.step(half).reward == 0  # a position earns once
    last = word.step(word.secret)
    assert last.info["success"] and last.reward == pytest.approx(0.25 + 0.5 * (1 - 0.2 * 3))
