"""`omrl bench soak [--minutes N]`: a default-shaped `omrl run` (the embedded Redis, the env
server, two actors, the evaluator, the learner) for N minutes (120; `--quick`: 10), sampling
every `SAMPLE_S` what would grow in a run of days:

- each process of the run (the supervisor, and each supervised process with everything in its
  process group: vLLM's engine processes count with their actor): resident memory (the sum of
  its processes' RSS: pages they share count once a process), open files, threads;
- Redis: used memory, keys, the rollouts streams' and the dead letters' lengths;
- the run directory's size on disk, and the steps trained.

Each series' row compares its last tenth (the median of those samples) with its second tenth
(the first is the start: engines warming up, the first checkpoints): the goal is every ratio
within 0.95-1.05, or a growth the docs name and bound. `per_hour` is the series' least-squares
slope after the first tenth, per hour: what a run of days would add. Nothing is sampled from inside the
processes: /proc and Redis's INFO, as an operator would.

Not in `omrl bench all` (it takes its minutes whatever `--quick` says of the others).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from benchmarks.common import pyplot, spread
from common.metrics import last_step
from common.progress import Progress

SAMPLE_S = 10.0
STEPS = 10**9  # the run goes on until the soak stops it


def run(quick: bool, device: str, minutes: float | None = None, out: Path | None = None) -> dict:
    """The soak's samples also go to OUT/soak.samples.jsonl as they are taken, so a soak cut
    short still leaves them; Ctrl-C ends it early, with the figures of what it sampled."""
    minutes = minutes or (10.0 if quick else 120.0)
    with tempfile.TemporaryDirectory(prefix="omrl-soak-") as root:
        run_dir = Path(root) / "run"
        log = open(Path(root) / "omrl.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir), "--steps",
                                 str(STEPS)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        samples: list[dict] = []
        kept = open(Path(out) / "soak.samples.jsonl", "w") if out else None
        started = time.monotonic()
        stopped_early = False
        bar = Progress(int(minutes * 60 / SAMPLE_S), f"soak, {minutes:g} min", "samples")
        try:
            while time.monotonic() - started < minutes * 60:
                if proc.poll() is not None:
                    raise RuntimeError(f"omrl run ended after {time.monotonic() - started:.0f}s with code "
                                       f"{proc.returncode}: {Path(log.name).read_text()[-3000:]}")
                sample = {"t": time.monotonic() - started, **sample_run(proc.pid, run_dir)}
                samples.append(sample)
                if kept:
                    kept.write(json.dumps(sample) + "\n")
                    kept.flush()
                bar.update(note=f"step {sample['steps']}")
                time.sleep(max(0.0, SAMPLE_S - (time.monotonic() - started - sample["t"])))
        except KeyboardInterrupt:
            stopped_early = True
        finally:
            if kept:
                kept.close()
            bar.close()
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    return {"minutes": minutes, "sample_s": SAMPLE_S, "stopped_early": stopped_early, "samples": samples,
            "rows": rows(samples)}


def sample_run(supervisor: int, run_dir: Path) -> dict:
    """One sample: per process group of the run, memory, files and threads; Redis; the disk."""
    table = proc_table()
    leaders = {pid: _role(pid) for pid, (ppid, _) in table.items() if ppid == supervisor}
    groups: dict[str, dict[str, float]] = {"supervisor": usage([supervisor])}
    for leader, role in leaders.items():
        members = [pid for pid, (_, pgrp) in table.items() if pgrp == leader]
        groups[role] = usage(members)
    return {"processes": groups, "redis": _redis(run_dir), "disk_mb": _du(run_dir) / 2**20, "steps": last_step(run_dir)}


def proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid{pid}"
    words = [w.decode(errors="replace") for w in cmd]
    if "redis-server" in words[0]:  # Redis rewrites its title: "PATH/redis-server HOST:PORT", one word
        return "redis"
    if "envs" in words:
        return "env-server"
    if "learner" in words:
        return "learner"
    if "--evaluator" in words:
        return "evaluator"
    if "--index" in words:
        return f"actor{words[words.index('--index') + 1]}"
    if "plot" in words:  # the live plot, drawn in a process of its own every run.plot_every_s
        return "plot"
    return f"pid{pid}"


def usage(pids: list[int]) -> dict[str, float]:
    """The group's resident memory (MB), open files and threads, summed over its processes."""
    rss = fds = threads = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # it ended meanwhile
        for line in status:
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return {"rss_mb": rss / 1024, "files": fds, "threads": threads, "processes": len(pids)}


def _redis(run_dir: Path) -> dict[str, float]:
    import redis

    from broker.keys import Keys

    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())["redis"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return {}
    keys = Keys(cfg["run"], cfg.get("shards", 1))
    client = redis.Redis.from_url(cfg["url"], socket_timeout=5)
    try:
        return {"memory_mb": client.info("memory")["used_memory"] / 2**20, "keys": client.dbsize(),
                "stream_entries": sum(client.xlen(s) for s in keys.streams),
                "dead_letters": client.xlen(keys.dead_letters)}
    except redis.RedisError:
        return {}  # restarting: a gap in the series
    finally:
        client.close()


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """name -> [(t, value)] of every sampled figure."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        figures = {f"{role} {k}": v for role, usage in s["processes"].items() for k, v in usage.items()}
        figures.update({f"redis {k}": v for k, v in s["redis"].items()})
        figures.update({"run dir MB": s["disk_mb"], "steps": s["steps"]})
        for name, value in figures.items():
            out.setdefault(name, []).append((s["t"], value))
    return out


def rows(samples: list[dict]) -> list[dict]:
    """A row a series: the median of its last tenth against that of its second tenth."""
    if not samples:
        return []
    end = samples[-1]["t"]
    out = []
    for name, points in series(samples).items():
        if name == "steps":
            continue
        second = [v for t, v in points if 0.1 * end <= t < 0.2 * end]
        last = [v for t, v in points if t >= 0.9 * end]
        if not second or not last:
            continue
        base, now = statistics.median(second), statistics.median(last)
        ratio = now / base if base else (1.0 if now == base else float("inf"))
        judged = [(t, v) for t, v in points if t >= 0.1 * end]
        out.append({"measure": f"{name} (last tenth / second tenth)", "system": now, "baseline": base,
                    "ratio": spread([ratio]), "per_hour": _slope(judged) * 3600})
    return out


def _slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of value over time (per second); 0 for fewer than two times."""
    ts = [t for t, _ in points]
    if len(set(ts)) < 2:
        return 0.0
    return statistics.linear_regression(ts, [v for _, v in points]).slope


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    data = series(result["samples"])
    minutes = result["samples"][-1]["t"] / 60 if result["samples"] else result["minutes"]  # less where cut short
    panels = [("resident memory, MB", "rss_mb"), ("open files", "files"), ("threads", "threads"),
              ("Redis", None), ("run dir MB and steps / 1000", None)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for ax, (title, key) in zip(axes, panels):
        if key is not None:
            chosen = {n.rsplit(" ", 1)[0]: pts for n, pts in data.items() if n.endswith(" " + key)}
        elif title == "Redis":
            chosen = {n: pts for n, pts in data.items() if n.startswith("redis ")}
        else:
            chosen = {"run dir MB": data.get("run dir MB", []),
                      "steps / 1000": [(t, v / 1000) for t, v in data.get("steps", [])]}
        for name, pts in chosen.items():
            brief = name.startswith(("pid", "plot"))  # a short-lived child of the supervisor: grey, unnamed
            ax.plot([t / 60 for t, _ in pts], [v for _, v in pts], label=None if brief else name,
                    **({"color": "grey", "lw": 0.8} if brief else {}))
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=3)
        ax.axvspan(0, 0.1 * minutes, color="grey", alpha=0.15)  # the start, not judged
    axes[-1].set_xlabel("minutes")
    fig.suptitle(f"omrl bench soak: a default run for {minutes:.0f} minutes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
