"""`python -m envs --env NAME --port P`: an env server speaking the AgentGym "id" protocol."""

from __future__ import annotations

import argparse
import asyncio
import signal

from common.cli import Preflight, add_config_args, config_from_args, log_config
from common.logs import setup_logging


async def _serve(cfg) -> None:
    from common.liveness import beating
    from envs.server import EnvServer, serve
    from envs.workers import WorkerPool

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    where = f"{cfg.env.name!r} listening on http://{cfg.env.host}:{cfg.env.port}"
    if cfg.env.workers == 1:
        runner = await serve(EnvServer(cfg.env.name, cfg.env.options), cfg.env.host, cfg.env.port)
        print(f"env server {where}", flush=True)
        beats = asyncio.create_task(beating())  # the loop that answers requests turns
        await stop.wait()
        beats.cancel()
        await runner.cleanup()
        return
    pool = WorkerPool(cfg.env.name, cfg.env.options, cfg.env.workers, cfg.env.host, cfg.env.port, cfg.run.log_level,
                      hang_s=cfg.supervisor.hang_s)
    started = asyncio.Event()
    run, listening = asyncio.create_task(pool.run(stop, started)), asyncio.create_task(started.wait())
    await asyncio.wait([run, listening], return_when=asyncio.FIRST_COMPLETED)
    listening.cancel()  # (still waiting where the pool failed to start: `await run` raises why)
    if started.is_set():
        print(f"env server {where} ({cfg.env.workers} worker processes, ports {pool.ports})", flush=True)
    beats = asyncio.create_task(beating())  # the pool's loop turns (a hung worker: the pool restarts it)
    try:
        await run
    finally:
        beats.cancel()


def main(argv: list[str] | None = None, preflight: Preflight | None = None) -> None:
    """`preflight(cfg, debug)` runs before anything starts (`omrl ROLE` passes the checks)."""
    parser = argparse.ArgumentParser(prog="omrl env-server", description="Serve a built-in env over HTTP.")
    add_config_args(parser)
    parser.add_argument("--env", help="env name (env.name)")
    parser.add_argument("--host", help="bind address (env.host)")
    parser.add_argument("--port", type=int, help="port (env.port)")
    parser.add_argument("--workers", type=int, help="processes serving envs behind the port (env.workers)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args, {"env.name": args.env, "env.host": args.host, "env.port": args.port,
                                  "env.workers": args.workers})
    if preflight is not None:
        preflight(cfg, args.debug)
    setup_logging("env", cfg.run.log_level)
    log_config(cfg)
    asyncio.run(_serve(cfg))


if __name__ == "__main__":
    main()
