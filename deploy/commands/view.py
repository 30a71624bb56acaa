"""`omrl view RUN_DIR`: a local web page to browse the episodes a run kept (RUN_DIR/samples.jsonl,
learner.samples_every): filter them by step, env, task, reward, success and staleness, read one
turn by turn with its tokens coloured by log-prob, advantage, weight version or loss mask, and
follow one task across steps. The page is one file (deploy/commands/view.html, no build step); the server
reads the run's files at every request, so a live run's new episodes show up as they are kept.

    omrl view runs/first              # http://127.0.0.1:8300/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).with_name("view.html")
SUMMARY = ("id", "step", "weight_version", "why", "env_name", "task_id", "reward", "success", "staleness",
           "finish_reason", "invalid_actions")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's directory (run.run_dir)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8300, help="port (0: any free one, printed)")


def app(run_dir: Path):
    import asyncio

    from aiohttp import web

    from learner.samples import FILE, ROTATED, read_samples

    cache: dict = {"files": None, "episodes": []}

    async def episodes() -> list[dict]:
        """The kept episodes, read again (in a thread) only when a file changed."""
        files = [(p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None
                 for p in (run_dir / ROTATED, run_dir / FILE)]
        if files != cache["files"]:
            cache.update(files=files, episodes=await asyncio.to_thread(read_samples, run_dir))
        return cache["episodes"]

    async def page(_request: web.Request) -> web.Response:
        return web.FileResponse(PAGE)

    async def index(_request: web.Request) -> web.Response:
        rows = [{k: e.get(k) for k in SUMMARY} | {"turns": len(e["turns"])} for e in await episodes()]
        return web.json_response({"run_dir": str(run_dir), "episodes": rows})

    async def episode(request: web.Request) -> web.Response:
        wanted = request.match_info["id"]
        found = next((e for e in await episodes() if e.get("id") == wanted), None)
        if found is None:
            return web.json_response({"error": f"no kept episode {wanted!r} in {run_dir}"}, status=404)
        return web.json_response(found)

    application = web.Application()
    application.router.add_get("/", page)
    application.router.add_get("/api/episodes", index)
    application.router.add_get("/api/episodes/{id}", episode)
    return application


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory: pass a run's directory (run.run_dir)", file=sys.stderr)
        return 2
    if not any(run_dir.glob("samples*.jsonl")):
        print(f"{run_dir} has no kept episodes yet (samples.jsonl: learner.samples_every steps after the start); "
              "the page shows them as they come", flush=True)

    def ready(runner) -> None:
        port = runner.addresses[0][1]
        print(f"episodes of {run_dir}: http://{args.host}:{port}/ (Ctrl-C stops)", flush=True)

    _serve(app(run_dir), args.host, args.port, ready)
    return 0


def _serve(application, host: str, port: int, ready) -> None:
    import asyncio

    from aiohttp import web

    from common.http import runner_for

    async def serve() -> None:
        runner = runner_for(application)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        ready(runner)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
