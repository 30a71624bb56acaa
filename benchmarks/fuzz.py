"""`omrl bench fuzz`: does a real env server's memory grow under malformed input? Rounds of
requests (any method and route; random bytes, JSON with the protocol's fields holding values
of any type, bodies past the size limit, ids that exist and that do not) go to `omrl
env-server` over real HTTP; the envs they create are closed at the end of each round, so what
is compared is what the requests leave behind. Row: the server's resident memory after the
last round against after the first (1.0: flat), and the answers' statuses (0: the server
closed the connection, as it may mid-way through a body past its limit): any 5xx or a dead
server fails the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

from benchmarks.common import pyplot, row, wait_http

ROUTES = {"/": "GET", "/stats": "GET", "/create": "POST", "/reset": "POST", "/step": "POST", "/observation": "GET",
          "/oracle": "GET", "/random": "GET", "/mistake": "GET", "/close": "POST", "/nope": "POST"}  # each route's own method
FIELDS = ["id", "data_idx", "action", "seed"]
VALUES = [None, True, 0, -5, 2**70, 1.5, "", "x" * 300, [1, 2], {"a": 1}]


def run(quick: bool, device: str = "cpu") -> dict:
    rounds, per_round = (3, 200) if quick else (10, 2000)
    from broker.embedded import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "envs", "--env", "letters", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_http(port, proc)
        rss, statuses = asyncio.run(_rounds(port, proc, rounds, per_round))
    finally:
        proc.terminate()
        proc.wait(30)
    if any(s >= 500 for s in statuses) or proc.returncode not in (0, -15):
        raise RuntimeError(f"the env server answered 5xx or died: statuses {sorted(set(statuses))}, "
                           f"exit code {proc.returncode}")
    return {"rounds": rounds, "requests_per_round": per_round, "rss_mb": rss,
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "rows": [row(f"env server resident memory after {rounds} rounds of {per_round} malformed requests "
                         "(last / first)", [rss[-1]], [rss[0]])]}


async def _rounds(port: int, proc: subprocess.Popen, rounds: int, per_round: int) -> tuple[list[float], list[int]]:
    import aiohttp

    rng, base = random.Random(0), f"http://127.0.0.1:{port}"
    rss, statuses = [], []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            created = []
            for _ in range(per_round):
                route = rng.choice(list(ROUTES))
                method = ROUTES[route] if rng.random() < 0.9 else rng.choice(["GET", "POST", "PUT", "DELETE"])
                body = _body(rng, created)
                query = {"id": body.decode(errors="replace")[:100]} if method == "GET" else None  # GETs: ids in the query
                try:
                    async with session.request(method, base + route, data=body, params=query) as resp:
                        answer = await resp.read()
                        statuses.append(resp.status)
                        if route == "/create" and resp.status == 200:
                            created.append(json.loads(answer)["id"])
                except aiohttp.ClientError:  # a body past the limit, answered 413 before it was sent whole
                    statuses.append(0)
            for env_id in created:
                async with session.post(base + "/close", json={"id": env_id}) as resp:
                    await resp.read()
            rss.append(_rss_mb(proc.pid))
    return rss, statuses


def _body(rng: random.Random, created: list[int]) -> bytes:
    kind = rng.random()
    if kind < 0.3:
        return rng.randbytes(rng.randint(0, 300))
    if kind < 0.6:
        return json.dumps({rng.choice(FIELDS): rng.choice(VALUES) for _ in range(rng.randint(0, 4))}).encode()
    if kind < 0.65:
        return b"x" * rng.randint(1 << 20, 3 << 20)  # past the size limit
    env_id = rng.choice(created) if created and rng.random() < 0.5 else rng.randint(0, 1 << 40)
    return json.dumps({"id": env_id, "action": rng.choice(["a", "", "x" * 50]), "data_idx": rng.randint(-1, 99)}).encode()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(result["rss_mb"]) + 1), result["rss_mb"], marker="o")
    ax.set_xlabel(f"round ({result['requests_per_round']} malformed requests each)")
    ax.set_ylabel("env server resident memory, MB")
    ax.set_ylim(bottom=0)
    ax.set_title("omrl bench fuzz: the env server's memory under malformed input", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
