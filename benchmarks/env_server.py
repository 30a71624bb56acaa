"""Env server throughput: requests/s and latency percentiles with many concurrent episodes,
against a baseline server that answers every route with a constant JSON (the cost of the
HTTP round trip alone), both started as separate processes and alternated.

    python -m benchmarks.env_server --env letters --episodes 256 --seconds 15 --repeats 3

Each episode loop creates an env, resets it to a task, steps with a fixed cycle of actions
until done (or --max-steps), closes it, and starts over. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import wait_http

ACTIONS = {
    "letters": ["a"],
    "babyai": ["turn left", "move forward", "turn right", "move forward"],
}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="letters", help="built-in env to serve")
    p.add_argument("--episodes", type=int, default=256, help="concurrent episode loops")
    p.add_argument("--seconds", type=float, default=15.0, help="measured time per repeat")
    p.add_argument("--repeats", type=int, default=3, help="alternations of server and baseline")
    p.add_argument("--max-steps", type=int, default=20, help="steps before an episode is closed unfinished")
    p.add_argument("--out", default="bench-results/env_server.json")


def main(args: argparse.Namespace) -> dict:
    report = measure(args)
    summary = report["summary"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"median over {args.repeats} repeats; env server / baseline: requests/s x{summary['ratio_requests_per_s']['median']:.2f}"
          f" (range {summary['ratio_requests_per_s']['min']:.2f}-{summary['ratio_requests_per_s']['max']:.2f}), "
          f"p99 x{summary['ratio_p99_ms']['median']:.2f}")
    return report


def measure(args: argparse.Namespace) -> dict:
    """Our env server and the baseline, alternated `args.repeats` times: every run and a
    summary (median, min, max of each figure and of the ratios)."""
    from broker.embedded import free_port

    results: dict[str, list[dict]] = {"env_server": [], "baseline": []}
    for _ in range(args.repeats):
        for kind in ("env_server", "baseline"):
            port = free_port()
            cmd = ([sys.executable, "-m", "envs", "--env", args.env, "--port", str(port), "--set", "run.log_level=WARNING"]
                   if kind == "env_server" else [sys.executable, "-m", "benchmarks.env_server", "--serve-baseline",
                                                 str(port)])
            server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_http(port, server)
                results[kind].append(asyncio.run(_load(port, args)))
            finally:
                server.terminate()
                server.wait(30)
            print(f"{kind:<10} {_line(results[kind][-1])}", flush=True)
    summary = {kind: _summary(runs) for kind, runs in results.items()}
    summary["ratio_requests_per_s"] = _ratio(results, "requests_per_s")
    summary["ratio_p99_ms"] = _ratio(results, "p99_ms")
    return {"env": args.env, "episodes": args.episodes, "seconds": args.seconds, "runs": results, "summary": summary}


async def _load(port: int, args: argparse.Namespace) -> dict:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    latencies: list[float] = []
    episodes_done = 0
    deadline = time.monotonic() + args.seconds
    actions = ACTIONS.get(args.env, ["a"])

    async def call(session, path: str, body: dict) -> dict:
        started = time.perf_counter()
        async with session.post(base + path, json=body) as resp:
            answer = await resp.json()
        latencies.append(time.perf_counter() - started)
        return answer

    async def episodes(session, worker: int) -> None:
        nonlocal episodes_done
        task = worker
        while time.monotonic() < deadline:
            env_id = (await call(session, "/create", {}))["id"]
            await call(session, "/reset", {"id": env_id, "data_idx": task})
            for step in range(args.max_steps):
                answer = await call(session, "/step", {"id": env_id, "action": actions[step % len(actions)]})
                if answer.get("done"):
                    break
            await call(session, "/close", {"id": env_id})
            episodes_done += 1
            task += args.episodes

    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.episodes)) as session:
        await asyncio.gather(*[episodes(session, w) for w in range(args.episodes)])
    elapsed = time.monotonic() - started
    latencies.sort()
    return {"requests": len(latencies), "requests_per_s": len(latencies) / elapsed,
            "episodes_per_s": episodes_done / elapsed, "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)]}


def _serve_baseline(port: int) -> None:
    """Every route answers a constant JSON at once: what the HTTP round trip costs alone."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        if request.can_read_body:
            await request.read()
        return web.json_response({"id": 0, "observation": "Say a", "reward": 0.0, "done": request.path == "/step"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _summary(runs: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in ("requests_per_s", "p50_ms", "p99_ms", "episodes_per_s")}


def _ratio(results: dict[str, list[dict]], key: str) -> dict:
    ratios = [a[key] / b[key] for a, b in zip(results["env_server"], results["baseline"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _line(r: dict) -> str:
    return (f"requests/s {r['requests_per_s']:8.0f}  episodes/s {r['episodes_per_s']:7.1f}  "
            f"p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-baseline":
        _serve_baseline(int(sys.argv[2]))
    else:
        parser = argparse.ArgumentParser(prog="python -m benchmarks.env_server", description=__doc__.split("\n")[0])
        add_cli_args(parser)
        main(parser.parse_args())
