"""`omrl bench env`: the env server's requests/s and p50/p99 latency from 1 to 512
concurrent episodes, on `letters` and on `babyai`, each point against a baseline server
that answers every route with a constant JSON (the HTTP round trip alone), alternated;
BabyAI also with 2 worker processes (`omrl env-server --workers 2`) against 1, alternated.

The ratios reported are requests/s of our server (one worker) over the baseline's at the
same concurrency (1.0 would mean the env and the server add nothing to HTTP), and of 2
workers over 1 (2.0 would be every added core's worth; the load generator shares them)."""

from __future__ import annotations

import argparse

from benchmarks import env_server
from benchmarks.common import pyplot

CONCURRENCY = (1, 8, 64, 256, 512)
QUICK_CONCURRENCY = (1, 8)
WORKERS = 2  # babyai's second server: processes behind the port


def run(quick: bool, device: str = "cpu") -> dict:
    # --quick runs letters with workers, so that a smoke test sees both kinds of figure.
    envs = {"letters": WORKERS} if quick else {"letters": 1, "babyai": WORKERS}
    points = []
    for env, workers in envs.items():
        for episodes in QUICK_CONCURRENCY if quick else CONCURRENCY:
            args = argparse.Namespace(env=env, episodes=episodes, seconds=1.0 if quick else 5.0,
                                      repeats=1 if quick else 3, max_steps=20, workers=workers)
            summary = env_server.measure(args)["summary"]
            points.append({"env": env, "episodes": episodes, "workers": workers, **summary})
    rows = []
    for p in points:  # the server of one worker against the baseline, then N workers against one
        one, ratio = ("one_worker", p["ratio_one_worker"]) if p["workers"] > 1 else ("env_server", p["ratio_requests_per_s"])
        rows.append({"measure": f"{p['env']}, {p['episodes']} episodes: requests/s", "ratio": ratio,
                     "system": p[one]["requests_per_s"]["median"], "baseline": p["baseline"]["requests_per_s"]["median"]})
    rows += [{"measure": f"{p['env']}, {p['episodes']} episodes: requests/s, {p['workers']} workers (baseline: 1 worker)",
              "system": p["env_server"]["requests_per_s"]["median"], "baseline": p["one_worker"]["requests_per_s"]["median"],
              "ratio": p["ratio_workers"]} for p in points if p["workers"] > 1]
    return {"points": points, "rows": rows}


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, (rate, p99) = plt.subplots(1, 2, figsize=(11, 4))
    for env in sorted({p["env"] for p in result["points"]}):
        points = [p for p in result["points"] if p["env"] == env]
        x = [p["episodes"] for p in points]
        workers = points[0]["workers"]
        kinds = ({"one_worker": ("env server", "-o"), "env_server": (f"env server, {workers} workers", "-s")}
                 if workers > 1 else {"env_server": ("env server", "-o")})
        for kind, (name, style) in {**kinds, "baseline": ("baseline", "--x")}.items():
            rate.plot(x, [p[kind]["requests_per_s"]["median"] for p in points], style, label=f"{env}: {name}")
            p99.plot(x, [p[kind]["p99_ms"]["median"] for p in points], style, label=f"{env}: {name}")
    for ax, title in ((rate, "requests/s"), (p99, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent episodes")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    rate.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
