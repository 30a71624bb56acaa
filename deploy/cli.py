"""The `omrl` command. Arguments are parsed before any heavy import, so --help is instant."""

from __future__ import annotations

import argparse
import sys

from common.cli import add_config_args
from common.config import EnvConfig


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="the embedded default: Redis, env server, actors and learner on this machine")
    add_config_args(p)
    p.add_argument("--steps", type=int, help="learner steps (learner.steps)")
    p.add_argument("--run-dir", help="where metrics.jsonl, logs and the model go (run.run_dir)")
    p.add_argument("--model", help="a Hugging Face causal LM, path or hub id (model.path); default: the tiny model")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="omrl", description="OpenManus-RL: asynchronous actor-learner RL for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    p = sub.add_parser("status", help="a run's streams, pending entries, dead letters, actors and learner")
    add_config_args(p)
    p.add_argument("--redis-url", help="the run's Redis (redis.url)")
    p.add_argument("--run", help="the run's name (redis.run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = sub.add_parser("eval", help="play the held-out tasks of envs: success rate and mean reward with 95%% CIs")
    add_config_args(p)
    from deploy.evaluate import add_args as add_eval_args

    add_eval_args(p)
    p = sub.add_parser("bench", help="throughput benchmarks, each against a baseline in the same run")
    from benchmarks.run import add_args as add_bench_args

    add_bench_args(p)
    p = sub.add_parser("tasks", help="task files")
    tasks = p.add_subparsers(dest="tasks_command", required=True)
    p = tasks.add_parser("make", help="write DIR/train.parquet and DIR/test.parquet for an env")
    p.add_argument("--env", required=True, help="env name")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--num-tasks", type=int, default=EnvConfig().num_tasks,
                   help="task indices 0..N-1, for envs whose spec does not say (default: env.num_tasks's default)")
    p.add_argument("--protocol", choices=("id", "env_idx"), help="AgentGym protocol family (env.protocol)")
    p = sub.add_parser("export", help="write a run's trained policy to OUT with save_pretrained (transformers, vLLM)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (config.toml, checkpoints/)")
    p.add_argument("out", metavar="OUT", help="a new (or empty) directory")
    p.add_argument("--step", type=int, help="the checkpoint of this learner step (default: the newest)")
    p = sub.add_parser("init-model", help="build a tiny Qwen2 model with random weights and its tokenizer in DIR")
    p.add_argument("dir")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, help="the MLP's width (default: 2 x hidden)")
    p.add_argument("--tie-embeddings", action="store_true", help="one matrix for the input embedding and output layer")
    p.add_argument("--tokenizer", choices=("char", "word"), default="char",
                   help="char: one token per character; word: one token per word of --env's text")
    p.add_argument("--env", help="the env whose text the word tokenizer learns (played by its oracle and random policy)")
    p.add_argument("--tasks", help="task files directory: the word tokenizer reads episodes of its train split")
    p.add_argument("--env-episodes", type=int, default=400, help="episodes of --env's text to learn the words from")
    p = sub.add_parser("collect", help="play an env's oracle (or random policy) and write the episodes as a "
                       "trajectory file (parquet)")
    from deploy.trajectories import add_collect_args, add_import_args

    add_config_args(p)
    add_collect_args(p)
    p = sub.add_parser("import-trajectories", help="AgentGym / OpenManus-RL conversation files (JSON, JSON lines) to "
                       "a trajectory file")
    add_config_args(p)
    add_import_args(p)
    p = sub.add_parser("sft", help="supervised fine-tuning on trajectory files, with a held-out success curve")
    from deploy.sft import add_args as add_sft_args

    add_config_args(p)
    add_sft_args(p)
    p = sub.add_parser("demo", help="a recipe end to end: oracle data, SFT, async RL, evaluation before and after")
    from deploy.demo import add_args as add_demo_args

    add_demo_args(p)
    # The role commands hand their arguments to the role's own parser.
    for name, help_text in (("env-server", "serve a built-in env over HTTP (AgentGym 'id' protocol)"),
                            ("actor", "run one rollout actor"), ("learner", "run the learner")):
        sub.add_parser(name, help=help_text, add_help=False)
    p = sub.add_parser("doctor", help="check everything a run needs (model, Redis, env server, ports, run dir, GPU)")
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    if argv and argv[0] in ("env-server", "actor", "learner"):
        role, rest = argv[0], argv[1:]
        if role == "env-server":
            from envs.__main__ import main as role_main
        elif role == "actor":
            from actors.__main__ import main as role_main
        else:
            from learner.__main__ import main as role_main
        role_main(rest, preflight=lambda cfg, debug: _preflight(cfg, role, debug))
        return
    args = parser.parse_args(argv)
    if args.command == "init-model":
        sys.exit(_init_model(args))
    elif args.command == "collect":
        from deploy.trajectories import collect_main

        sys.exit(collect_main(args))
    elif args.command == "import-trajectories":
        from deploy.trajectories import import_main

        sys.exit(import_main(args))
    elif args.command == "sft":
        from deploy.sft import main as sft_main

        sys.exit(sft_main(args))
    elif args.command == "demo":
        from deploy.demo import main as demo_main

        sys.exit(demo_main(args))
    elif args.command == "export":
        from common.logs import setup_logging
        from deploy.export import export

        setup_logging("export", "INFO", sys.stderr)  # stdout is the output path
        print(export(args.run_dir, args.out, args.step))
    elif args.command == "status":
        sys.exit(_status(args))
    elif args.command == "eval":
        from common.cli import stop_on_sigterm
        from common.logs import setup_logging
        from deploy.evaluate import main as eval_main

        setup_logging("eval", "INFO", sys.stderr)  # stdout is the table or the JSON
        stop_on_sigterm()
        sys.exit(eval_main(args))
    elif args.command == "bench":
        from benchmarks.run import main as bench_main

        sys.exit(bench_main(args))
    elif args.command == "tasks":
        from envs.tasks import write_task_files

        try:
            paths = write_task_files(args.env, args.out, args.num_tasks, args.protocol)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        for split, path in paths.items():
            print(f"{split}: {path}")
    elif args.command == "run":
        from deploy.supervisor import run

        sys.exit(run(args))
    elif args.command == "doctor":
        sys.exit(_doctor(args))


def _init_model(args: argparse.Namespace) -> int:
    from common.models import build_word_tokenizer, init_tiny_model

    tokenizer = None
    if args.tokenizer == "word":
        if not args.env:
            print("error: --tokenizer word learns its words from an env's text: pass --env NAME", file=sys.stderr)
            return 2
        from envs.corpus import env_texts
        from envs.tasks import task_split

        train, _test = task_split(EnvConfig(name=args.env, tasks=args.tasks))
        tokenizer = build_word_tokenizer(env_texts(args.env, train, episodes=args.env_episodes))
    print(init_tiny_model(args.dir, hidden=args.hidden, layers=args.layers, heads=args.heads,
                          tie_embeddings=args.tie_embeddings, tokenizer=tokenizer, intermediate=args.intermediate))
    return 0


ROLE_WAIT_S = 30.0  # a role started beside its servers (compose, Kubernetes) gives them this to come up


def _preflight(cfg, role: str, debug: bool) -> None:
    from deploy.preflight import require

    require(cfg, role, debug, wait_s=ROLE_WAIT_S)


def _doctor(args: argparse.Namespace) -> int:
    from common.cli import config_from_args
    from deploy.preflight import doctor_report, print_cause, run_checks

    cfg = config_from_args(args)
    results = run_checks(cfg, "doctor")
    if args.debug:
        for r in results:
            if r.status == "fail":
                print_cause(r)
    print(doctor_report(results, args.json))
    return 2 if any(r.status == "fail" for r in results) else 0


def _status(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from broker.status import format_status, status_of
    from common.cli import config_from_args

    extra = [f"redis.url={json.dumps(args.redis_url)}"] if args.redis_url else []
    extra += [f"redis.run={json.dumps(args.run)}"] if args.run else []
    cfg = config_from_args(args, extra)
    if not cfg.redis.url:
        print("error: no Redis to ask: pass --redis-url or --config RUN_DIR/config.toml", file=sys.stderr)
        return 2

    status = asyncio.run(status_of(cfg.redis))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


if __name__ == "__main__":
    main()
