"""`omrl status`: a run's streams, pending entries, dead letters, actors and learner."""

from __future__ import annotations

import argparse
import sys

from common.cli import add_config_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--redis-url", help="the run's Redis (redis.url)")
    p.add_argument("--run", help="the run's name (redis.run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def main(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from broker.status import format_status, status_of
    from common.cli import config_from_args

    cfg = config_from_args(args, {"redis.url": args.redis_url or None, "redis.run": args.run or None})
    if not cfg.redis.url:
        print("error: no Redis to ask: pass --redis-url or --config RUN_DIR/config.toml", file=sys.stderr)
        return 2

    status = asyncio.run(status_of(cfg.redis))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
