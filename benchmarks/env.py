"""`omrl bench env`: the env server's requests/s and p50/p99 latency from 1 to 512
concurrent episodes, on `letters` and on `babyai`, each point against a baseline server
that answers every route with a constant JSON (the HTTP round trip alone), alternated.

The ratio reported is requests/s of our server over the baseline's at the same
concurrency: 1.0 would mean the env and the server add nothing to HTTP."""

from __future__ import annotations

import argparse

from benchmarks import env_server
from benchmarks.common import pyplot

CONCURRENCY = (1, 8, 64, 256, 512)
QUICK_CONCURRENCY = (1, 8)


def run(quick: bool, device: str = "cpu") -> dict:
    envs = ("letters",) if quick else ("letters", "babyai")
    points = []
    for env in envs:
        for episodes in QUICK_CONCURRENCY if quick else CONCURRENCY:
            args = argparse.Namespace(env=env, episodes=episodes, seconds=1.0 if quick else 5.0,
                                      repeats=1 if quick else 3, max_steps=20)
            summary = env_server.measure(args)["summary"]
            points.append({"env": env, "episodes": episodes, **summary})
    rows = [{"measure": f"{p['env']}, {p['episodes']} episodes: requests/s",
             "system": p["env_server"]["requests_per_s"]["median"], "baseline": p["baseline"]["requests_per_s"]["median"],
             "ratio": p["ratio_requests_per_s"]} for p in points]
    return {"points": points, "rows": rows}


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, (rate, p99) = plt.subplots(1, 2, figsize=(11, 4))
    for env in sorted({p["env"] for p in result["points"]}):
        points = [p for p in result["points"] if p["env"] == env]
        x = [p["episodes"] for p in points]
        for kind, style in (("env_server", "-o"), ("baseline", "--x")):
            label = f"{env}: {'env server' if kind == 'env_server' else 'baseline'}"
            rate.plot(x, [p[kind]["requests_per_s"]["median"] for p in points], style, label=label)
            p99.plot(x, [p[kind]["p99_ms"]["median"] for p in points], style, label=label)
    for ax, title in ((rate, "requests/s"), (p99, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent episodes")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    rate.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
