"""Env server throughput: requests/s and latency percentiles with many concurrent episodes,
against a baseline server that answers every route with a constant JSON (the cost of the
HTTP round trip alone), both started as separate processes and alternated; with --workers
N, the server of one worker alternates with them too (N workers / 1 worker).

    python -m benchmarks.env_server --env letters --episodes 256 --seconds 15 --repeats 3
    python -m benchmarks.env_server --env babyai --episodes 64 --seconds 5 --workers 2

The load generator is one process of hand-written keep-alive HTTP/1.1 connections (one to
the server's port and one to each worker an episode loop's envs land on, following /create's
`endpoint` as envs/client.py does) on uvloop where it is installed: it costs a fraction of
aiohttp's client per request, so on a small machine the cores go to the servers.

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
    p.add_argument("--workers", type=int, default=1, help="env server processes (omrl env-server --workers)")
    p.add_argument("--out", default="bench-results/env_server.json")


def main(args: argparse.Namespace) -> dict:
    report = measure(args)
    summary = report["summary"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"median over {args.repeats} repeats; env server / baseline: requests/s {_range(summary['ratio_requests_per_s'])}, "
          f"p99 x{summary['ratio_p99_ms']['median']:.2f}")
    if "ratio_workers" in summary:
        print(f"{args.workers} workers / 1 worker: requests/s {_range(summary['ratio_workers'])}")
    return report


def measure(args: argparse.Namespace) -> dict:
    """Our env server (of --workers processes) and the baseline, alternated `args.repeats`
    times, and with --workers above 1 the server of one worker too (`one_worker`): every run
    and a summary (median, min, max of each figure and of the ratios, taken repeat by repeat)."""
    from broker.embedded import free_port

    workers = getattr(args, "workers", 1)
    kinds = {"env_server": workers, **({"one_worker": 1} if workers > 1 else {}), "baseline": 0}
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, n in kinds.items():
            port = free_port()
            cmd = ([sys.executable, "-m", "envs", "--env", args.env, "--port", str(port), "--workers", str(n),
                    "--set", "run.log_level=WARNING"]
                   if n else [sys.executable, "-m", "benchmarks.env_server", "--serve-baseline", str(port)])
            server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_http(port, server)
                with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                    results[kind].append(runner.run(_load(port, args)))
            finally:
                server.terminate()
                server.wait(30)
            print(f"{kind:<10} {_line(results[kind][-1])}", flush=True)
    summary = {kind: _summary(runs) for kind, runs in results.items()}
    summary["ratio_requests_per_s"] = _ratio(results["env_server"], results["baseline"], "requests_per_s")
    summary["ratio_p99_ms"] = _ratio(results["env_server"], results["baseline"], "p99_ms")
    if workers > 1:
        summary["ratio_workers"] = _ratio(results["env_server"], results["one_worker"], "requests_per_s")
        summary["ratio_one_worker"] = _ratio(results["one_worker"], results["baseline"], "requests_per_s")
    return {"env": args.env, "episodes": args.episodes, "workers": workers, "seconds": args.seconds,
            "runs": results, "summary": summary}


def _loop_factory():
    """uvloop's event loop where it is installed (vLLM brings it): the load generator then takes
    about 65 us of CPU a request against 90-115 on asyncio's own loop (BabyAI, 2 workers, 64
    episodes), leaving the servers more of a small machine's cores."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Connection:
    """One keep-alive HTTP/1.1 connection written by hand: a load generator lean enough that the
    servers, not the client, take the machine's cores (aiohttp's client costs about as much
    per request as aiohttp's server)."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), self.port, len(data), data))
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0])
        answer = json.loads(await self.reader.readexactly(length))
        if not head.startswith(b"HTTP/1.1 200"):
            status = head.split(b"\r\n", 1)[0].decode()
            raise RuntimeError(f"POST {path}: {status}: {answer}")
        return answer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _load(port: int, args: argparse.Namespace) -> dict:
    base = f"http://127.0.0.1:{port}"
    latencies: list[float] = []
    episodes_done = 0
    deadline = time.monotonic() + args.seconds
    actions = ACTIONS.get(args.env, ["a"])

    async def call(conn: _Connection, path: str, body: dict) -> dict:
        started = time.perf_counter()
        answer = await conn.post(path, body)
        latencies.append(time.perf_counter() - started)
        return answer

    async def episodes(loop_index: int) -> None:
        nonlocal episodes_done
        task = loop_index
        front = _Connection(base)
        workers: dict[str, _Connection] = {}  # a connection to each worker this loop's envs were on
        try:
            while time.monotonic() < deadline:
                created = await call(front, "/create", {})
                env_id, url = created["id"], created.get("endpoint")  # a worker's own port, as our client does
                conn = front if url is None else workers.setdefault(url, _Connection(url))
                await call(conn, "/reset", {"id": env_id, "data_idx": task})
                for step in range(args.max_steps):
                    answer = await call(conn, "/step", {"id": env_id, "action": actions[step % len(actions)]})
                    if answer.get("done"):
                        break
                await call(conn, "/close", {"id": env_id})
                episodes_done += 1
                task += args.episodes
        finally:
            for conn in (front, *workers.values()):
                conn.close()

    started = time.monotonic()
    await asyncio.gather(*[episodes(w) for w in range(args.episodes)])
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


def _ratio(system: list[dict], baseline: list[dict], key: str) -> dict:
    ratios = [a[key] / b[key] for a, b in zip(system, baseline)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _range(ratio: dict) -> str:
    return f"x{ratio['median']:.2f} (range {ratio['min']:.2f}-{ratio['max']:.2f})"


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
