"""`omrl demo babyai|textcraft`: from an oracle to an agent that RL improves, end to end on one
machine. One recipe; what differs between the envs is in RECIPES (the split into strata, the
turn caps, the model's shape, the stages' defaults):

    1. tasks      the env's tasks in strata, each with a train and a held-out test split:
                  BabyAI's levels (default 1 GoToRedBallGrey, 4 GoToObjS6, 5 GoToLocalS8N7; AgentGym's
                  indexing, task i: level i % 40 + 1, seed i // 40; test seeds never appear in
                  training); TextCraft's 544 goals by the depth of their recipe tree, a held-out
                  share of every depth (144 goals in all: goals never crafted in training)
    2. model      a Qwen2 from scratch with a word tokenizer learned from the env's text
    3. collect    the oracle's episodes on the train split (`omrl collect`); TextCraft's with a
                  fifth of the turns mistakes (a wrong count, an early craft, a random action)
                  left out of the loss (`--collect-noise`), so they show recovering from
                  them, over 10 variants of each train goal; with --sft-shuffle-names SHARE
                  that share of the tasks in worlds of their own item names (--rl-shuffle-names:
                  the RL stage's), where no answer is known by heart, only read from the recipes
    4. sft        supervised fine-tuning on them (`omrl sft`), with a held-out success curve
    5. before     the SFT model plays each stratum's held-out tasks greedily; with
                  --eval-samples K (TextCraft: 8) also K sampled episodes a task at temperature 1:
                  pass@1 with an interval clustered by task
   (dagger)       with --dagger SHARE: the SFT model plays SHARE of the turns of the oracle's
                  episodes on the RL strata's train tasks, sampled and outside the loss; the
                  oracle's turns label the states the model reaches (`omrl collect --mistakes
                  model`: DAgger's data), OUT/dagger.parquet, the RL stage's supervised term
    6. rl         the async loop (`omrl run`: Redis, env server, vLLM actors, learner) from the
                  SFT model on the RL strata's train split; with --rl-sft COEF the learner also
                  trains on stage 3's episodes (or with --dagger, on the dagger stage's) at that
                  weight (learner.sft_coef)
    7. after      the RL model plays the same held-out tasks
                  (with --seeds N, stages 6 and 7 again for seeds 1..N-1: rl-seed1, after-seed1, ...;
                  seed s sets learner.seed = s and actor.seed = 100 s)
    8. report     OUT/report.md (the tables with 95% intervals; over several seeds each stratum's
                  change with its 95% t-interval; the wall time of each stage), OUT/report.json,
                  OUT/demo.png (SFT curve, RL curve, before/after)

Each stage but the evaluations is a command of its own, run as a child process (its log under
OUT/logs); a stage recorded as done in OUT/stages.json is skipped, so an interrupted demo goes on
where it stopped (--fresh starts over). OUT/flags.json holds the flags each done stage ran with
(STAGE_FLAGS): a flag left out takes its recorded value, and an invocation that gives a done stage
another one names it and stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common.config import to_toml
from common.files import write_atomic
from common.progress import Progress
from common.stats import interval

log = logging.getLogger("omrl.demo")

TEST_SEEDS = 100_000  # BabyAI's held-out seeds start here: far from every seed the train split uses
# The RL stage (the ablations are in the README): GRPO with the decoupled PPO loss, no KL penalty
# (a frozen reference's forward cost a third of each step), the learner on both cores' threads.
# lr: a quarter of the 1e-4 the demo measured with one update a batch, as the default's 4
# minibatch updates a batch take it (docs/results/staleness.md).
LEARNER = {"algorithm": "grpo", "lr": 2.5e-5, "kl_coef": 0.0, "groups_per_step": 8, "entropy_coef": 0.0,
           "eval_every": 0, "threads": 2}
RL_ACTOR = {"group_size": 8, "num_actors": 1, "concurrent_groups": 8, "temperature": 1.0}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An env's settings of the demo. `actor`: what every stage shares (AgentGym's raw action
    text after the observation, turns capped as AgentGym's client must cap them: its servers
    never end an episode on turns); `model`: `omrl init-model`'s shape and template; `defaults`: the
    command line's, where it leaves them out; `own`: the flags only this recipe takes; `split`:
    {stratum: (train task ids, test task ids)} and {stratum the RL stage trains on: its task ids}
    from the command line; `label`: a stratum's name in the report; `pool`: a column the task files
    get, (name, a task's value), that pools tasks for actor.task_sampling = "spread" (actor.task_pool)."""
    env: str
    stratum: str  # what a stratum is called: "level", "depth"
    task: str  # what a held-out task is: "task", "task (goal)"
    actor: dict
    model: tuple[str, ...]
    defaults: dict
    own: tuple[str, ...]
    split: Callable[[argparse.Namespace], tuple[dict[str, tuple[list[int], list[int]]], dict[str, list[int]]]]
    label: Callable[[str], str]
    pool: tuple[str, Callable[[int], int]] | None = None


def babyai_split(args: argparse.Namespace) -> tuple[dict[str, tuple[list[int], list[int]]],
                                                  dict[str, list[int]]]:
    """{level: (train task ids, test task ids)}, and {level the RL stage trains on: its task ids}."""
    levels, rl_levels = _numbers(args.levels, "--levels", 1, 40), _numbers(args.rl_levels, "--rl-levels", 1, 40)
    if not set(rl_levels) <= set(levels):
        raise SystemExit(f"error: --rl-levels {rl_levels} must be among --levels {levels}")
    test = range(TEST_SEEDS, TEST_SEEDS + args.eval_episodes)
    strata = {str(level): (task_ids([level], range(args.train_seeds)), task_ids([level], test)) for level in levels}
    return strata, {str(level): strata[str(level)][0] for level in rl_levels}


def babyai_label(key: str) -> str:
    from envs.babyai import LEVELS

    return f"{key} {LEVELS[int(key) - 1]}"


def textcraft_split(args: argparse.Namespace) -> tuple[dict[str, tuple[list[int], list[int]]],
                                                     dict[str, list[int]]]:
    """{depth: (train task ids, test task ids)}, and {depth the RL stage trains on: its task ids}:
    the depth's train tasks, or with --rl-goals goals of their own that SFT never sees."""
    from envs.textcraft import GOALS, goal_depths

    if not 1 <= args.test_goals < GOALS:
        raise SystemExit(f"error: --test-goals takes 1-{GOALS - 1}, got {args.test_goals}")
    if args.variants < 1:
        raise SystemExit(f"error: --variants takes 1 or more, got {args.variants}")
    by_depth: dict[int, list[int]] = {}
    for goal, depth in enumerate(goal_depths()):
        by_depth.setdefault(depth, []).append(goal)
    quotas = shares(args.test_goals, {depth: len(goals) for depth, goals in by_depth.items()})
    rl_depths = _numbers(args.rl_depths, "--rl-depths", 1, max(by_depth))
    train_goals = {depth: len(goals) - quotas[depth] for depth, goals in by_depth.items() if depth in rl_depths}
    most = sum(train_goals.values()) - len(train_goals)  # SFT keeps a train goal of every RL depth
    if not 0 <= args.rl_goals <= most:
        raise SystemExit(f"error: --rl-goals takes 0-{most} (SFT keeps a train goal of every RL depth), "
                         f"got {args.rl_goals}")
    rl_quotas = shares(args.rl_goals, train_goals) if args.rl_goals else {}
    for depth, quota in rl_quotas.items():  # a depth's share rounded up to all of its train goals
        if quota >= train_goals[depth]:
            raise SystemExit(f"error: --rl-goals {args.rl_goals} gives depth {depth} all {train_goals[depth]} of its "
                             f"train goals (a share of each RL depth) and SFT none: give fewer")
    rng, strata, rl_train = random.Random(args.split_seed), {}, {}
    tasks = lambda goals: [goal + GOALS * variant for variant in range(args.variants) for goal in sorted(goals)]  # noqa: E731
    for depth, goals in sorted(by_depth.items()):
        goals = rng.sample(goals, len(goals))
        held, kept = goals[:quotas[depth]], goals[quotas[depth]:]
        rl_only = kept[:rl_quotas.get(depth, 0)]  # drawn after the held-out ones: --rl-goals leaves them as they were
        strata[str(depth)] = (tasks(kept[len(rl_only):]), sorted(held))
        if depth in rl_depths:
            rl_train[str(depth)] = tasks(rl_only) if rl_only else strata[str(depth)][0]
    return strata, rl_train


MODEL = ("--hidden", "128", "--layers", "3", "--heads", "2", "--intermediate", "384")  # 0.76M parameters
BABYAI = Recipe("babyai", "level", "task",
                {"max_turns": 10, "max_tokens": 16, "max_seq_len": 2048, "action_template": "raw"}, MODEL,
                {"levels": "1,4,5", "rl_levels": "1,5", "train_seeds": 4000, "episodes": 4000, "eval_episodes": 1000,
                 "eval_samples": 0, "collect_noise": 0.0, "sft_epochs": 2.0, "sft_eval_start": True, "sft_lr": 1e-3,
                 "sft_batch_size": 32, "sft_eval_episodes": 200, "rl_steps": 60},
                ("levels", "rl_levels", "train_seeds", "eval_episodes"), babyai_split, babyai_label)


def textcraft_goal(task: int) -> int:
    """A TextCraft task's goal (task g + 544 v: goal g among variant v's distractors)."""
    from envs.textcraft import GOALS

    return task % GOALS


# TextCraft: the oracle takes 2 turns at depth 1 on average, 5 at 2, 11 at 3 (48 at most), 19 at 4,
# and more than 30 on 2 goals of 544 (so 30 turns: a failing episode played to the cap costs most);
# a first observation is 132 words on average, 695 at most; an action 22 words at most. The CPU's
# default KV cache (64 MB, about 21,000 tokens of this model) made vLLM preempt 64 such episodes
# over and over: 512 MB (docs/results/textcraft-demo.md).
TEXTCRAFT = Recipe("textcraft", "depth", "task (goal)",
                   {"max_turns": 30, "max_tokens": 40, "max_seq_len": 4096, "action_template": "raw", "kv_cache_mb": 512},
                   (*MODEL, "--template", "turns"),  # its refusals repeat the action: each turn marked
                   {"test_goals": 144, "split_seed": 0, "episodes": 0, "eval_samples": 8, "collect_noise": 0.2,
                    "sft_epochs": 4.0, "sft_eval_start": False, "sft_lr": 1e-3, "sft_batch_size": 16,
                    "sft_eval_episodes": 48, "rl_steps": 60, "variants": 10, "rl_depths": "1,2,3,4",
                    "rl_goals": 0, "sft_shuffle_names": 0.0, "rl_shuffle_names": 0.0},
                   ("test_goals", "split_seed", "variants", "rl_depths", "rl_goals", "sft_shuffle_names",
                    "rl_shuffle_names"), textcraft_split,
                   lambda key: f"depth {key}", ("goal", textcraft_goal))
RECIPES = {r.env: r for r in (BABYAI, TEXTCRAFT)}
STAGES = ("tasks", "model", "collect", "sft", "before")  # then "rl" and "after" for each seed
# The flags each stage's output depends on (its seeds' stages, rl-seedN and after-seedN, as rl and
# after): recorded in OUT/flags.json as each stage ends, a later invocation that gives a done stage
# others refuses to go on, instead of skipping it as it was.
STAGE_FLAGS = {
    "tasks": ("levels", "train_seeds", "eval_episodes", "test_goals", "split_seed", "variants", "rl_goals"),
    "model": (),
    "collect": ("episodes", "collect_noise", "sft_shuffle_names"),
    "sft": ("sft_epochs", "sft_lr", "sft_batch_size", "sft_eval_episodes", "sft_eval_start"),
    "before": ("eval_samples", "constrain_actions"),
    "dagger": ("dagger", "episodes", "rl_depths", "rl_levels"),
    "rl": ("rl_depths", "rl_levels", "rl_shuffle_names", "rl_steps", "rl_sft", "dagger", "constrain_actions",
           "overrides"),
    "after": ("eval_samples", "constrain_actions"),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", choices=tuple(RECIPES), help="the recipe")
    p.add_argument("--out", help="where everything goes (default runs/demo-RECIPE)")
    p.add_argument("--levels", help="babyai: BabyAI levels (1-40) of the data and the evaluation (default 1,4,5)")
    p.add_argument("--rl-levels", help="babyai: levels the RL stage trains on (default 1,5: GoToRedBallGrey and "
                   "GoToLocal, about half the groups each)")
    p.add_argument("--train-seeds", type=int, help="babyai: seeds 0..N-1 of each level form the train split (4000)")
    p.add_argument("--eval-episodes", type=int, help="babyai: held-out episodes per level, before and after (1000)")
    p.add_argument("--test-goals", type=int, help="textcraft: held-out goals, a share of every depth (144 of 544)")
    p.add_argument("--split-seed", type=int, help="textcraft: which goals of each depth are held out (0)")
    p.add_argument("--variants", type=int, help="textcraft: tasks a train goal, each with other distractor recipes "
                                                "(task g + 544 v, v < N; the held-out goals are played as AgentGym's "
                                                "tasks, v = 0) (10)")
    p.add_argument("--rl-depths", help="textcraft: recipe depths whose train goals the RL stage trains on (default "
                                       "1,2,3,4: all)")
    p.add_argument("--rl-goals", type=int, help="textcraft: train goals of the RL depths (a share of each) that SFT "
                                                "never sees and RL alone trains on, as new to the model as the held-out "
                                                "ones (0: RL on SFT's goals)")
    p.add_argument("--sft-shuffle-names", type=float, metavar="SHARE",
                   help="textcraft: the share of the oracle's train tasks (SFT's data) played in worlds of their own "
                        "item names (env.options.shuffle_names; the evaluations keep the game's names) (0)")
    p.add_argument("--rl-shuffle-names", type=float, metavar="SHARE",
                   help="textcraft: the same share of the RL stage's tasks (0)")
    p.add_argument("--episodes", type=int, help="oracle episodes to fine-tune on, and --dagger's (babyai 4000; "
                                                "textcraft: 0, one per train task)")
    p.add_argument("--eval-samples", type=int, help="sampled episodes per held-out task besides the greedy one, "
                                                    "for pass@1 (babyai 0, textcraft 8)")
    p.add_argument("--collect-noise", type=float, help="the share of the oracle's turns a mistake takes, "
                                                       "outside the loss: episodes that show recovering from "
                                                       "mistakes (babyai 0, textcraft 0.2)")
    p.add_argument("--sft-epochs", type=float)
    p.add_argument("--sft-lr", type=float)
    p.add_argument("--sft-batch-size", type=int, help="episodes per SFT step")
    p.add_argument("--sft-eval-episodes", type=int, help="held-out episodes of each point of SFT's success curve "
                                                         "(babyai 200; textcraft 48: an untrained model plays every "
                                                         "turn)")
    p.add_argument("--sft-eval-start", action=argparse.BooleanOptionalAction,
                   help="the SFT curve's point before training (babyai yes; textcraft no: an untrained model plays "
                        "all 30 turns of every goal)")
    p.add_argument("--rl-steps", type=int, help="learner steps of the RL stage (60)")
    p.add_argument("--rl-sft", type=float, default=0.0, metavar="COEF",
                   help="the RL stage's supervised term on the oracle's episodes SFT trained on (OUT/oracle.parquet) "
                        "beside its loss, at this weight (learner.sft_coef; default 0: off)")
    p.add_argument("--dagger", type=float, default=0.0, metavar="SHARE",
                   help="with --rl-sft: the supervised term's episodes are the oracle's with SHARE of their turns "
                        "played by the SFT model (sampled, outside the loss; OUT/dagger.parquet, on the RL stage's "
                        "train tasks): the oracle's labels on the states the model reaches (default 0: the oracle's "
                        "own episodes)")
    p.add_argument("--constrain-actions", action="store_true",
                   help="every stage's model writes one of the actions the env admits now (actor.constrain_actions: "
                        "a mask on its tokens; the evaluations too)")
    p.add_argument("--seeds", type=int, default=1, help="RL stages from the same SFT model, each with its seed and "
                                                        "its evaluation after (default 1)")
    p.add_argument("--set", dest="overrides", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override a field of the RL stage's config (repeatable), e.g. --set learner.lr=5e-5")
    p.add_argument("--fresh", action="store_true", help="start over: ignore the outputs of earlier stages")


def main(args: argparse.Namespace) -> int:
    from common.cli import stop_on_sigterm
    from common.logs import setup_logging

    setup_logging("demo", "INFO", sys.stderr)
    stop_on_sigterm()
    demo = make_demo(args)
    demo.until_rl()
    for seed in range(args.seeds):
        rl, after = seed_names(seed)
        demo.stage(rl, lambda rl=rl, seed=seed: demo.rl(rl, seed_overrides(seed)))
        demo.stage(after, lambda rl=rl, after=after: demo.evaluate(f"{rl}-model", after))
    demo.bar.close()
    report = demo.report()
    print(report, flush=True)  # before the engines' teardown at exit
    return 0


def make_demo(args: argparse.Namespace) -> Demo:
    """The recipe's defaults filled in where the command line left them out, its flags checked,
    and OUT made (emptied first with --fresh)."""
    recipe = RECIPES[args.recipe]
    others = {flag for r in RECIPES.values() for flag in r.own} - set(recipe.own)
    given = sorted(flag_name(flag) for flag in others if getattr(args, flag) is not None)
    if given:
        raise SystemExit(f"error: {', '.join(given)} is not a flag of the {recipe.env} recipe")
    args.out = args.out or f"runs/demo-{recipe.env}"
    # A flag left out takes what the done stages ran with (OUT/flags.json), then the recipe's default:
    # a resume needs no flags again, and one given otherwise is refused (Demo).
    if not args.fresh:
        done, recorded = recorded_stages(Path(args.out))
        for name, flags in recorded.items():
            for field, value in flags.items():
                if name in done and getattr(args, field, None) is None:
                    setattr(args, field, value)
    for field, value in {**recipe.defaults, "overrides": []}.items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.seeds < 1:
        raise SystemExit(f"error: --seeds takes 1 or more, got {args.seeds}")
    if args.dagger and not (0 < args.dagger < 1 and args.rl_sft > 0):
        raise SystemExit(f"error: --dagger takes a share in (0, 1), for the supervised term: give --rl-sft COEF too "
                         f"(got --dagger {args.dagger}, --rl-sft {args.rl_sft})")
    for flag in ("sft_shuffle_names", "rl_shuffle_names"):
        share = getattr(args, flag)
        if share is not None and not 0 <= share <= 1:
            raise SystemExit(f"error: {flag_name(flag)} takes a share of the tasks, from 0 to 1, got {share}")
    strata, rl_train = recipe.split(args)
    out = Path(args.out)
    if args.fresh and out.exists():
        import shutil

        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return Demo(out, args, recipe, strata, rl_train)


def shares(total: int, sizes: dict[int, int]) -> dict[int, int]:
    """`total` split in proportion to `sizes`, at least 1 each, rounded by largest remainder:
    the parts add up to `total` (where it is at least the number of parts)."""
    whole = sum(sizes.values())
    exact = {key: total * n / whole for key, n in sizes.items()}
    parts = {key: max(1, int(x)) for key, x in exact.items()}
    by_remainder = sorted(exact, key=lambda k: exact[k] - parts[k], reverse=True)
    for key in by_remainder:  # short: the largest remainders get one more
        if sum(parts.values()) >= total:
            break
        parts[key] += 1
    for key in reversed(by_remainder):  # over, from the ones of 1: the smallest remainders give one back
        if sum(parts.values()) <= total:
            break
        if parts[key] > 1:
            parts[key] -= 1
    return parts


def interleave(lists: list[list[int]]) -> list[int]:
    """The lists' items in one list whose every prefix takes from each list in proportion to its
    length (lists of one length: round robin), each list's order kept."""
    ranked = sorted((i / len(items), k, item) for k, items in enumerate(lists) for i, item in enumerate(items))
    return [item for _position, _k, item in ranked]


def recorded_stages(out: Path) -> tuple[dict[str, float], dict[str, dict]]:
    """OUT/stages.json (each done stage's seconds) and OUT/flags.json (the flags it ran with); empty where absent."""
    def read(name: str) -> dict:
        return json.loads((out / name).read_text()) if (out / name).exists() else {}
    return read("stages.json"), read("flags.json")


def flag_name(field: str) -> str:
    """An args field's flag on the command line."""
    return "--set" if field == "overrides" else "--" + field.replace("_", "-")


def seed_names(seed: int) -> tuple[str, str]:
    """The RL stage's and its evaluation's names for a seed (its run directory, its results)."""
    return ("rl", "after") if seed == 0 else (f"rl-seed{seed}", f"after-seed{seed}")


def seed_overrides(seed: int) -> list[str]:
    from common.cli import override

    return [override("learner.seed", seed), override("actor.seed", 100 * seed)]


def _numbers(text: str, flag: str, low: int, high: int) -> list[int]:
    """A flag's comma-separated numbers (BabyAI's levels, TextCraft's depths), sorted, each in low-high."""
    try:
        numbers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"error: {flag} takes numbers {low}-{high} separated by commas, got {text!r}") from None
    if not numbers or not all(low <= x <= high for x in numbers):
        raise SystemExit(f"error: {flag} takes numbers {low}-{high}, got {text!r}")
    return numbers


def task_ids(levels: list[int], seeds: range) -> list[int]:
    """AgentGym's indices of the levels' tasks with these seeds (task i: level i % 40 + 1, seed i // 40)."""
    return [seed * 40 + level - 1 for seed in seeds for level in levels]


class Demo:
    def __init__(self, out: Path, args: argparse.Namespace, recipe: Recipe, strata: dict, rl_train: dict):
        self.out, self.args, self.recipe, self.strata, self.rl_train = out, args, recipe, strata, rl_train
        self.rl_strata = list(rl_train)
        self.env = recipe.env
        self.times: dict[str, float] = {}
        self.skipped: list[str] = []
        self.state_path = out / "stages.json"
        self.flags_path = out / "flags.json"
        self.done, self.flags = recorded_stages(out)
        for name in (n for n in self.done if n in self.flags):  # in the order they ran
            given = self.flags_of(name)
            differ = [flag for flag in given if self.flags[name].get(flag) != given[flag]]
            if differ:
                said = ", ".join(f"{flag_name(f)} {self.flags[name].get(f)!r} (now {given[f]!r})" for f in differ)
                raise SystemExit(f"error: {out}'s stage {name} was done with {said}: give the same, or start over "
                                 f"with --fresh (or another --out)")
        if args.dagger and "dagger" not in self.done and any(name.startswith("rl") for name in self.done):
            raise SystemExit(f"error: {out} holds an RL stage trained without --dagger's data; start over with "
                             f"--fresh (or another --out)")
        self.bar = Progress(len(STAGES) + bool(args.dagger) + 2 * args.seeds, "stages", "demo")

    def stage(self, name: str, body) -> None:
        if name in self.done:
            log.info("stage %s: done before (%.0f s), skipped", name, self.done[name])
            self.times[name] = self.done[name]
            self.skipped.append(name)
            self.bar.update(note=f"{name} done before")
            return
        log.info("stage %s", name)
        t0 = time.monotonic()
        body()
        self.times[name] = self.done[name] = time.monotonic() - t0
        self.flags[name] = self.flags_of(name)
        write_atomic(self.flags_path, json.dumps(self.flags, indent=2))
        write_atomic(self.state_path, json.dumps(self.done, indent=2))  # a later invocation resumes from it
        log.info("stage %s: %.0f s", name, self.times[name])
        self.bar.update(note=name)

    def flags_of(self, name: str) -> dict:
        """The flags stage `name` depends on, as this invocation gives them (STAGE_FLAGS)."""
        kind = name.split("-seed")[0]
        return {flag: json.loads(json.dumps(getattr(self.args, flag, None))) for flag in STAGE_FLAGS[kind]}

    def omrl(self, name: str, *argv: str, overrides: list[str] = ()) -> None:
        """An `omrl` command as a child process, its output in OUT/logs/NAME.log."""
        from common.cli import CommandFailed, run_omrl

        try:
            run_omrl(list(argv), self.out / "logs" / f"{name}.log", overrides)
        except CommandFailed as exc:
            raise SystemExit(f"error: stage {name} failed (exit {exc.code}); its log: {exc.log_path}\n"
                             + "\n".join(exc.tail[-5:])) from None

    def until_rl(self) -> None:
        """The stages before RL: tasks, the model, the oracle's data, SFT, the evaluation before."""
        self.stage("tasks", self.tasks)
        self.stage("model", self.model)
        self.stage("collect", self.collect)
        self.stage("sft", self.sft)
        self.stage("before", lambda: self.evaluate("sft", "before"))
        if self.args.dagger:
            self.stage("dagger", self.dagger)

    @property
    def actor(self) -> dict:
        """The recipe's actor settings, and the mask on its actions where asked for."""
        return {**self.recipe.actor, **({"constrain_actions": True} if self.args.constrain_actions else {})}

    def stratum_dir(self, key: str) -> Path:
        return self.out / "tasks" / f"{self.recipe.stratum}-{key}"

    def label(self, key: str) -> str:
        return self.recipe.label(key)

    def row_label(self, key: str) -> str:
        """A report row's name: the stratum's, marked where RL trained on it, or "all"."""
        return "all" if key == "all" else f"{self.label(key)}{' (RL)' if key in self.rl_strata else ''}"

    # -- stages ----------------------------------------------------------------------
    def tasks(self) -> None:
        # Interleaved: `omrl collect --episodes N` plays the first N train tasks and SFT's curve
        # the first held-out ones, so every prefix holds each stratum in proportion.
        self.write_pooled("all", {k: tr for k, (tr, _te) in self.strata.items()})
        for key, (train, test) in self.strata.items():
            write_tasks(self.stratum_dir(key), self.env, train, test, self.recipe.pool)
        (self.out / "config.toml").write_text(to_toml({"env": {"name": self.env}, "actor": self.actor}))

    def write_pooled(self, name: str, train: dict[str, list[int]]) -> Path:
        """OUT/tasks/NAME: the strata's train tasks given and their held-out ones, interleaved."""
        write_tasks(self.out / "tasks" / name, self.env, interleave(list(train.values())),
                    interleave([self.strata[k][1] for k in train]), self.recipe.pool)
        return self.out / "tasks" / name

    def rl_tasks(self) -> Path:
        """OUT/tasks/rl, the RL strata's tasks, written by the stage that plays them (not the tasks
        stage): a demo resumed with other --rl-depths/--rl-levels plays its own."""
        return self.write_pooled("rl", self.rl_train)

    def model(self) -> None:
        self.omrl("model", "init-model", str(self.out / "model0"), "--tokenizer", "word", "--env", self.env,
                  "--tasks", str(self.out / "tasks" / "all"), *self.recipe.model)

    def collect(self) -> None:
        episodes = self.args.episodes or sum(len(train) for train, _test in self.strata.values())
        self.omrl("collect", "collect", "--config", str(self.out / "config.toml"), "--env", self.env,
                  "--tasks", str(self.out / "tasks" / "all"), "--episodes", str(episodes), "--out",
                  str(self.out / "oracle.parquet"), "--model", str(self.out / "model0"), "--only-success",
                  "--noise", str(self.args.collect_noise), overrides=self.shuffled("sft_shuffle_names"))

    def dagger(self) -> None:
        """The RL train tasks once each (the first --episodes of them where given), the SFT model
        sampling a share of the turns: every episode kept (the oracle's labels hold in a failing
        one too)."""
        episodes = self.args.episodes or sum(len(train) for train in self.rl_train.values())
        self.omrl("dagger", "collect", "--config", str(self.out / "config.toml"), "--env", self.env,
                  "--tasks", str(self.rl_tasks()), "--episodes", str(episodes), "--out",
                  str(self.out / "dagger.parquet"), "--model", str(self.out / "sft"), "--mistakes", "model",
                  "--noise", str(self.args.dagger))

    def shuffled(self, flag: str) -> list[str]:
        """The env option of a share of tasks in worlds of their own names (TextCraft's), where given."""
        from common.cli import override

        share = getattr(self.args, flag, None)
        return [override("env.options.shuffle_names", share)] if share else []

    def sft(self) -> None:
        self.omrl("sft", "sft", "--config", str(self.out / "config.toml"), "--data", str(self.out / "oracle.parquet"),
                  "--model", str(self.out / "model0"), "--out", str(self.out / "sft"), "--tasks",
                  str(self.out / "tasks" / "all"), "--epochs", str(self.args.sft_epochs), "--lr", str(self.args.sft_lr),
                  "--batch-size", str(self.args.sft_batch_size),
                  "--eval-every", str(self.args.sft_epochs / 2), "--eval-episodes", str(self.args.sft_eval_episodes),
                  "--eval-start" if self.args.sft_eval_start else "--no-eval-start")

    def evaluate(self, model: str, name: str) -> None:
        """OUT/NAME.json: each stratum's held-out tasks played greedily; with --eval-samples,
        OUT/NAME-sampled.json too."""
        greedy, sampled = evaluate_strata(self.out, self.out / model, self.env, [self.stratum_dir(k) for k in self.strata],
                                          self.args.eval_samples)
        keys = list(self.strata)
        write_atomic(self.out / f"{name}.json", json.dumps(dict(zip(keys, greedy, strict=True)), indent=2))
        if sampled:
            write_atomic(self.out / f"{name}-sampled.json", json.dumps(dict(zip(keys, sampled, strict=True)), indent=2))

    def rl(self, name: str = "rl", overrides: list[str] = ()) -> None:
        """The RL stage from the SFT model: run dir OUT/NAME, its model exported to OUT/NAME-model
        (`overrides` after the command line's --set: the staleness study's arms)."""
        learner = {**LEARNER, "steps": self.args.rl_steps}
        if self.args.rl_sft:
            data = self.out / ("dagger.parquet" if self.args.dagger else "oracle.parquet")
            learner.update(sft_coef=self.args.rl_sft, sft_data=[str(data.resolve())])
        config = {"env": {"name": self.env, "tasks": str(self.rl_tasks())},
                  "actor": {**self.actor, **RL_ACTOR}, "learner": learner}
        (self.out / "rl.toml").write_text(to_toml(config))
        self.omrl(name, "run", "--config", str(self.out / "rl.toml"), "--model", str(self.out / "sft"), "--run-dir",
                  str(self.out / name), overrides=[*self.shuffled("rl_shuffle_names"), *self.args.overrides, *overrides])
        self.omrl(f"{name}-export", "export", str(self.out / name), str(self.out / f"{name}-model"))

    # -- the report --------------------------------------------------------------------
    def report(self) -> str:
        def read(name: str) -> dict | None:
            path = self.out / f"{name}.json"
            return json.loads(path.read_text()) if path.exists() else None

        before, after = read("before"), read("after")
        head = [f"| {self.recipe.stratum} | episodes | after SFT | after SFT + RL | change |", "|---|---|---|---|---|"]
        lines = [f"Greedy, one episode a held-out {self.recipe.task}:", "", *head]
        lines += table_rows(self, before, after)
        sampled = (read("before-sampled"), read("after-sampled"))
        if all(sampled):
            lines += ["", f"Sampled at temperature 1, {self.args.eval_samples} episodes a held-out task: pass@1, its "
                          "interval clustered by task:", "", *head]
            lines += table_rows(self, *sampled)
        afters = [a for a in (read(seed_names(seed)[1]) for seed in range(self.args.seeds)) if a]
        gains = {}
        if len(afters) > 1:
            gains["greedy"] = seed_gains(self, before, afters)
            lines += ["", f"RL over {len(afters)} seeds, greedy: each {self.recipe.stratum}'s change in points, the "
                          "mean over seeds with its 95% t-interval:", "", *gains_table(self, gains["greedy"])]
            sampled_afters = [a for a in (read(seed_names(seed)[1] + "-sampled") for seed in range(self.args.seeds)) if a]
            if sampled[0] and len(sampled_afters) == len(afters):
                gains["sampled"] = seed_gains(self, sampled[0], sampled_afters)
                lines += ["", f"RL over {len(afters)} seeds, sampled pass@1:", "", *gains_table(self, gains["sampled"])]
        stages = ", ".join(f"{k} {v / 60:.1f} min" for k, v in self.times.items())
        resumed = f" (stages {', '.join(self.skipped)} ran in an earlier invocation)" if self.skipped else ""
        lines += ["", f"Wall time {sum(self.times.values()) / 60:.1f} min, the sum of the stages{resumed}: {stages}."]
        text = "\n".join(lines)
        (self.out / "report.md").write_text(text + "\n")
        write_atomic(self.out / "report.json", json.dumps({
            "recipe": self.env, "before": before, "after": after, "before_sampled": sampled[0],
            "after_sampled": sampled[1], "seeds_gains": gains, "times_s": self.times, "rl_strata": self.rl_strata},
            indent=2))
        plot_demo(self, before, after, gains)
        return text


def table_rows(demo: Demo, before: dict, after: dict) -> list[str]:
    """A row per stratum, and one for all of them where there are several."""
    rows = [(demo.row_label(key), before[key], after[key]) for key in demo.strata]
    if len(demo.strata) > 1:
        rows.append((demo.row_label("all"), pooled(list(before.values())), pooled(list(after.values()))))
    return [f"| {label} | {a['episodes']} | {_pct(b)} | {_pct(a)} | {100 * (a['success'] - b['success']):+.1f} |"
            for label, b, a in rows]


def seed_gains(demo: Demo, before: dict, afters: list[dict]) -> dict:
    """Per stratum (and "all" where there are several): each seed's change in points from
    `before`, and their mean with its 95% t-interval."""
    pools = {key: [key] for key in demo.strata}
    if len(demo.strata) > 1:
        pools["all"] = list(demo.strata)
    return {key: pool_gain(before, afters, strata) for key, strata in pools.items()}


def pool_gain(before: dict, afters: list[dict], strata: list[str]) -> dict:
    """Each seed's change in points of `strata` pooled (results as `evaluate` writes them, by
    stratum), and their mean with its 95% t-interval."""
    def success(results: dict) -> float:
        return pooled([results[key] for key in strata])["success"] if len(strata) > 1 else results[strata[0]]["success"]

    changes = [100 * (success(after) - success(before)) for after in afters]
    mean, lo, hi = interval(changes)
    return {"changes": changes, "mean": mean, "ci": [lo, hi]}


def gains_table(demo: Demo, gains: dict) -> list[str]:
    lines = [f"| {demo.recipe.stratum} | change per seed | mean [95% CI] |", "|---|---|---|"]
    for key, g in gains.items():
        lines.append(f"| {demo.row_label(key)} | {', '.join(f'{c:+.1f}' for c in g['changes'])} | {g['mean']:+.1f} "
                     f"[{g['ci'][0]:+.1f}, {g['ci'][1]:+.1f}] |")
    return lines


def pooled(results: list[dict]) -> dict:
    """Strata's results as one: Wilson over every episode, or clustered by task where the tasks
    had several episodes each."""
    from actors.evaluate import clustered, wilson

    episodes = sum(r["episodes"] for r in results)
    if all(r.get("per_task") for r in results):
        success, ci = clustered({t: rate for r in results for t, rate in r["per_task"].items()})
    else:
        wins = round(sum(r["success"] * r["episodes"] for r in results))
        success, ci = wins / episodes, wilson(wins, episodes)
    return {"episodes": episodes, "success": success, "success_ci": list(ci)}


def write_tasks(out: Path, env: str, train: list[int], test: list[int],
                pool: tuple[str, Callable[[int], int]] | None = None) -> None:
    """Task files of `train` and `test` in OUT, with the column `pool` names (Recipe.pool) where given."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for split_name, idx in (("train", train), ("test", test)):
        columns = {"env": [env] * len(idx), "task_idx": pa.array(idx, pa.int64()), "split": [split_name] * len(idx)}
        if pool is not None:
            columns[pool[0]] = pa.array([pool[1](t) for t in idx], pa.int64())
        pq.write_table(pa.table(columns), out / f"{split_name}.parquet")


def config_variant(out: Path, name: str, dotted: str, value) -> Path:
    """OUT/NAME/config.toml: the demo's config (OUT/config.toml) with the field `dotted` (e.g.
    "env.options.shuffle_names") set to `value`, for an evaluation beside the demo's own
    (`evaluate_strata(OUT/NAME, ...)`). Returns OUT/NAME."""
    import tomllib

    config = tomllib.loads((out / "config.toml").read_text())
    *path, field = dotted.split(".")
    section = config
    for key in path:
        section = section.setdefault(key, {})
    section[field] = value
    (out / name).mkdir(exist_ok=True)
    write_atomic(out / name / "config.toml", to_toml(config))
    return out / name


def evaluate_strata(out: Path, model: Path, env: str, dirs: list[Path], samples: int = 0) -> tuple[list, list]:
    """With one engine, the model plays each directory's held-out tasks greedily and, with
    `samples`, that many episodes a task at temperature 1: (greedy results, sampled results),
    EvalResults as dicts."""
    import asyncio

    from common.cli import override
    from common.config import load_config
    from deploy.evaluate import ModelPlayer
    from envs.tasks import read_tasks

    cfg = load_config(out / "config.toml", [override("model.path", str(model))])

    async def play() -> tuple[list, list]:
        greedy, sampled = [], []
        async with ModelPlayer(cfg, env) as player:
            for path in dirs:
                tasks = read_tasks(path / "test.parquet", env)
                greedy.append(dataclasses.asdict(await player.play(tasks)))
                if samples:
                    sampled.append(dataclasses.asdict(await player.play(tasks, temperature=1.0, samples=samples)))
        return greedy, sampled

    return asyncio.run(play())


def plot_demo(demo: Demo, before: dict, after: dict, gains: dict | None = None) -> Path:
    """OUT/demo.png: the SFT held-out curve, the RL training curve of each seed, success before
    and after (seed 0), and with several seeds each stratum's change per seed with the mean's
    95% t-interval (`gains`: the report's, seed_gains' sampled where there are, else greedy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.metrics import read_jsonl
    from deploy.plots import _rolling_mean, errorbar_ci

    out, keys = demo.out, list(demo.strata)
    fig, axes = plt.subplots(1, 4 if gains else 3, figsize=(20 if gains else 15, 3.8))
    sft_ax, rl_ax, bar_ax = axes[:3]
    sft = [r for r in read_jsonl(out / "sft" / "sft_metrics.jsonl") if "eval/success" in r]
    errorbar_ci(sft_ax, [r["epoch"] for r in sft], [r["eval/success"] for r in sft],
              [r["eval/success_ci"] for r in sft], "o-")
    sft_ax.set(title=f"SFT: held-out success, every {demo.recipe.stratum} (greedy)", xlabel="epoch")
    for seed in range(demo.args.seeds):
        path = out / seed_names(seed)[0] / "metrics.jsonl"
        if not path.exists():
            continue
        rl = read_jsonl(path)
        steps, success = [r["step"] for r in rl], [r.get("reward/success", float("nan")) for r in rl]
        if demo.args.seeds == 1:
            rl_ax.plot(steps, success, alpha=0.3, label="per step")
        rl_ax.plot(steps, _rolling_mean(success, 10), label="mean of 10" if demo.args.seeds == 1 else f"seed {seed}")
    rl_ax.set(title="RL: training success (sampled, T=1)" + (", mean of 10" if demo.args.seeds > 1 else ""),
              xlabel="learner step")
    rl_ax.legend(fontsize=8)
    x = range(len(keys))
    for shift, (label, results) in ((-0.2, ("after SFT", before)), (0.2, ("after SFT + RL", after))):
        ys = [results[key]["success"] for key in keys]
        cis = [results[key]["success_ci"] for key in keys]
        bar_ax.bar([i + shift for i in x], ys, width=0.4, label=label)
        errorbar_ci(bar_ax, [i + shift for i in x], ys, cis, "none", color="black")
    bar_ax.set_xticks(list(x), [demo.label(key) for key in keys], fontsize=8)
    bar_ax.set(title=f"held-out success per {demo.recipe.stratum}, greedy (95% CI)", ylim=(0, 1))
    bar_ax.legend(fontsize=8, loc="lower right")
    if gains:
        kind = "sampled" if "sampled" in gains else "greedy"
        gains = gains[kind]
        gain_ax, labels = axes[3], list(gains)
        for i, key in enumerate(labels):
            gain_ax.plot([i] * len(gains[key]["changes"]), gains[key]["changes"], "o", color="tab:gray", alpha=0.6)
        errorbar_ci(gain_ax, range(len(labels)), [gains[k]["mean"] for k in labels], [gains[k]["ci"] for k in labels],
                    "s", color="tab:red", label="mean, 95% t-interval")
        gain_ax.axhline(0, color="black", lw=0.8)
        gain_ax.set_xticks(range(len(labels)), [demo.label(k) if k != "all" else "all" for k in labels], fontsize=8)
        gain_ax.set(title=f"RL's change in points, {kind}, {demo.args.seeds} seeds (grey: each)")
        gain_ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pct(r: dict) -> str:
    return f"{100 * r['success']:.1f}% [{100 * r['success_ci'][0]:.1f}, {100 * r['success_ci'][1]:.1f}]"
