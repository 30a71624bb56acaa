"""`omrl bench scale`: the broker with N = 1, 16, 128 and 1024 actor group loops on one Redis.

The real actor (actors/worker.py's `Actor`: admission tickets, episodes over HTTP against a
real `letters` env server, the producer, heartbeats, the weight receiver) with a simulated
engine in place of vLLM (each turn's length drawn from an exponential of mean TOKENS tokens, at
most MAX_TOKENS, generated at RATE tokens/s), N loops spread over up to PROCESSES actor processes; and the
learner's real intake (learner/bridge.py's `BrokerBridge`: reads, decoding, the janitor,
acknowledgements) with a simulated trainer step of STEP_S seconds per B groups, publishing a
version every step as the learner does (the bytes through Redis, its state, `published`). The
trainer is the bottleneck from N = 16 on: the actors wait at the staleness bound most of the
time, which is where polling cost most. One Redis server of the benchmark's own.

Two arms per N, run in turn: `doorbell` (the system: waits block on the doorbell,
broker/doorbell.py) and `polling` (the baseline: a waiting group or producer tries again every
50 ms, as before issue 27, recreated here by replacing `Doorbell.wait` with that sleep).

Per N and arm, over WINDOW_S after WARMUP_S: groups/s taken in by the learner; Redis commands/s
and commands per trained group (INFO commandstats); Redis CPU in cores (INFO cpu) and memory
(INFO memory); the admission wait p50/p99 of the groups admitted in the window (censored: a loop
still waiting at the window's end is not counted); the hash and EVAL traffic per second (HSET,
HGETALL, EVAL: heartbeats and slot renewals, the learner's member watch, weight records, the
learner's wake-ups), which bounds what membership costs. Heartbeats are one a process every
actor.heartbeat_s, whatever N is.
Output: OUT/scale.json (a row per N and arm, `points`) and OUT/scale.png.

Goals (issue 27): commands per trained group flat in N (within 1.5x from 16 to 1024), intake at
1024 at least 0.9 of intake at 16, Redis below half a core at 1024.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import pyplot, spread, wait_http

LOOPS = (1, 16, 128, 1024)
QUICK_LOOPS = (8,)
PROCESSES = 4  # actor processes at most; N loops split evenly over them
B, ETA, STEP_S = 16, 2, 1.0  # groups per step, the staleness bound, the simulated trainer's step
RATE, TOKENS, MAX_TOKENS = 100.0, 8, 16  # the simulated engine: tokens/s a request, mean and most tokens a turn
WARMUP_S, WINDOW_S = 10.0, 30.0
QUICK_WARMUP_S, QUICK_WINDOW_S = 2.0, 3.0
POLL_S = 0.05  # the baseline's polling period (broker/admission.py and streams.py before issue 27)
ARMS = ("doorbell", "polling")
HASH_AND_EVAL = ("hset", "hgetall", "eval")  # heartbeats, slot renewals, the member watch, weight records, wake-ups


class SimEngine:
    """vLLM's place: a turn of n tokens (exponential, mean TOKENS) takes n / RATE seconds and
    answers the letter 'a' n - 1 times then a newline, each token at log-prob -1."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.letter = tokenizer.encode("a", add_special_tokens=False)
        self.newline = tokenizer.encode("\n", add_special_tokens=False)
        self.rng = random.Random(seed)

    async def generate(self, prompt_ids, max_tokens, temperature=None, turn_start=None, sent=None, stops=None,
                       choices=None):
        from actors.engine import Generation

        n = max(1, min(max_tokens, round(self.rng.expovariate(1 / TOKENS))))
        await asyncio.sleep(n / RATE)
        ids = (self.letter * n)[:n - 1] + self.newline
        return Generation(ids, [-1.0] * len(ids), "stop")

    async def load_weights(self, path: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def settings(redis_url: str, env_port: int, model: str, run_dir: str, loops: int) -> list[str]:
    from common.cli import override

    return [override(k, v) for k, v in {
        "redis.url": redis_url, "redis.run": "scale", "redis.max_stream_len": 2 * B, "model.path": model,
        "run.run_dir": run_dir, "run.log_level": "WARNING", "env.name": "letters", "env.port": env_port,
        "actor.group_size": 2, "actor.concurrent_groups": loops, "actor.max_tokens": MAX_TOKENS,
        "learner.groups_per_step": B, "learner.eta": ETA, "learner.checkpoint_every": 1}.items()]


def actor_main(argv: list[str]) -> None:
    """One actor process (`python -m benchmarks.scale --actor ARM INDEX OUT SETTINGS...`): runs
    until SIGTERM, then writes its admission waits to OUT."""
    arm, index, out, sets = argv[0], int(argv[1]), Path(argv[2]), argv[3:]
    from transformers import AutoTokenizer

    from actors.worker import Actor
    from broker import doorbell
    from common.config import load_config
    from common.logs import setup_logging

    cfg = load_config(None, sets, environ={})
    setup_logging("actor", cfg.run.log_level)
    if arm == "polling":
        async def poll(self, stop=None) -> bool:
            await asyncio.sleep(POLL_S)
            return False
        doorbell.Doorbell.wait = poll
    actor = Actor(cfg, index=index, engine=SimEngine(AutoTokenizer.from_pretrained(cfg.model.path), index))
    asyncio.run(actor.run())
    out.write_text(json.dumps({"waits": list(actor.admission.waits), "groups": actor.groups}))


class SimLearner(threading.Thread):
    """The learner's intake with a simulated step: B groups through the real bridge, STEP_S of
    sleep, acknowledge, publish the next version. `trained`: (time, groups trained so far)."""

    def __init__(self, redis_cfg):
        super().__init__(daemon=True)
        self.redis_cfg, self.stop, self.trained = redis_cfg, threading.Event(), [(time.time(), 0)]
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the benchmark's thread
            self.error = exc

    def _run(self) -> None:
        from broker.admission import announce_step
        from learner.bridge import BrokerBridge

        bridge = BrokerBridge(self.redis_cfg, consumer="learner-0", keep_versions=3, queue_size=2 * B,
                              read_count=B, admission=(B, ETA)).start()
        blob = b"w" * 4096

        async def publish(step: int):
            await bridge.store.publish(step, step, blob)
            await announce_step(bridge.client, bridge.keys, step, step, step * B, B, ETA)  # as the learner does

        try:
            bridge.call(lambda: publish(0))
            step = 0
            while not self.stop.is_set():
                batch = []
                while len(batch) < B and not self.stop.is_set():
                    if (delivery := bridge.get(0.2)) is not None:
                        batch.append(delivery)
                if len(batch) < B:
                    return
                time.sleep(STEP_S)
                bridge.ack(batch)
                step += 1
                bridge.call(lambda: publish(step))
                self.trained.append((time.time(), step * B))
        finally:
            bridge.stop()


def trained_between(trained: list[tuple[float, int]], start: float, end: float) -> tuple[int, float]:
    """Groups trained in [start, end] and the time from the first step before start to the
    last in it (whole steps, so a window that catches 3 steps counts 3 steps' time)."""
    before = [t for t in trained if t[0] <= start][-1]
    inside = [t for t in trained if start < t[0] <= end]
    if not inside:
        return 0, end - start
    return inside[-1][1] - before[1], inside[-1][0] - before[0]


def redis_figures(url: str) -> dict:
    """Per-command calls and microseconds, CPU seconds and memory, from INFO."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        cpu = client.info("cpu")
        memory = client.info("memory")
    finally:
        client.close()
    return {"calls": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()},
            "usec": {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()},
            "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), "memory": int(memory["used_memory"])}


def measure(root: Path, model: str, loops: int, arm: str, warmup_s: float, window_s: float) -> dict:
    """One point: a Redis, an env server, a simulated learner and the actor processes; figures over the window."""
    from broker.embedded import EmbeddedRedis, free_port
    from common.config import load_config

    processes = min(loops, PROCESSES)
    per = [loops // processes + (i < loops % processes) for i in range(processes)]
    run_dir = root / f"{arm}-{loops}"
    run_dir.mkdir(parents=True)
    log = open(run_dir / "procs.log", "ab")
    with EmbeddedRedis() as server, contextlib.ExitStack() as stack:
        env_port = free_port()
        base = settings(server.url, env_port, model, str(run_dir), 1)
        env = subprocess.Popen([sys.executable, "-m", "envs", *[a for s in base for a in ("--set", s)]],
                               stdout=log, stderr=subprocess.STDOUT)
        stack.callback(_stop, env)
        wait_http(env_port, env)
        learner = SimLearner(load_config(None, base, environ={}).redis)
        learner.start()
        stack.callback(learner.join, 30)
        stack.callback(learner.stop.set)
        outs = [run_dir / f"actor-{i}.json" for i in range(processes)]
        actors = [subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "--actor", arm, str(i), str(outs[i]),
                                    *settings(server.url, env_port, model, str(run_dir), n)],
                                   stdout=log, stderr=subprocess.STDOUT) for i, n in enumerate(per)]
        for proc in actors:
            stack.callback(_stop, proc)
        deadline = time.time() + 120  # the first group in: every process is up
        while learner.trained[-1][1] == 0 and len(learner.trained) < 2:
            _check(learner, actors, run_dir, deadline)
            time.sleep(0.2)
        time.sleep(warmup_s)
        first, start = redis_figures(server.url), time.time()
        while time.time() < start + window_s:
            _check(learner, actors, run_dir, start + window_s + 60)
            time.sleep(0.2)
        last, end = redis_figures(server.url), time.time()
        for proc in actors:
            proc.send_signal(signal.SIGTERM)
        for proc in actors:
            proc.wait(120)
        learner.stop.set()
    waits = sorted(w for out in outs for t, w in json.loads(out.read_text())["waits"] if start <= t <= end)
    groups, seconds = trained_between(learner.trained, start, end)
    calls = {k: last["calls"][k] - first["calls"].get(k, 0) for k in last["calls"]}
    usec = {k: last["usec"][k] - first["usec"].get(k, 0) for k in last["usec"]}
    span = end - start
    result = {"loops": loops, "arm": arm, "processes": processes, "window_s": span, "groups": groups,
              "groups_per_s": groups / seconds, "commands_per_s": sum(calls.values()) / span,
              "commands_per_group": sum(calls.values()) / max(groups, 1),
              "redis_cpu": (last["cpu_s"] - first["cpu_s"]) / span, "redis_memory_mb": last["memory"] / 2 ** 20,
              "wait_p50_s": _quantile(waits, 0.5), "wait_p99_s": _quantile(waits, 0.99), "admitted": len(waits),
              "hash_and_eval_per_s": sum(calls.get(k, 0) for k in HASH_AND_EVAL) / span,
              "hash_and_eval_usec_share": sum(usec.get(k, 0) for k in HASH_AND_EVAL) / max(sum(usec.values()), 1),
              "calls_per_s": {k: v / span for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v}}
    print(f"scale N={loops:<5} {arm:<8} groups/s {result['groups_per_s']:6.2f}  Redis {result['commands_per_s']:8.0f} "
          f"commands/s ({result['commands_per_group']:6.1f} a group), {result['redis_cpu']:.3f} cores, "
          f"{result['redis_memory_mb']:.1f} MB  wait p50 {result['wait_p50_s']:.3f} s p99 {result['wait_p99_s']:.3f} s",
          flush=True)
    return result


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _check(learner: SimLearner, actors: list[subprocess.Popen], run_dir: Path, deadline: float) -> None:
    if learner.error is not None:
        raise RuntimeError("the simulated learner failed") from learner.error
    for proc in actors:
        if proc.poll() is not None:
            raise RuntimeError(f"an actor exited ({proc.returncode}): "
                               f"{(run_dir / 'procs.log').read_text(errors='replace')[-3000:]}")
    if time.time() > deadline:
        raise TimeoutError(f"no progress in time: {(run_dir / 'procs.log').read_text(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(60)


def run(quick: bool, device: str = "cpu") -> dict:
    from common.models import init_tiny_model

    loops_sweep = QUICK_LOOPS if quick else LOOPS
    warmup_s, window_s = (QUICK_WARMUP_S, QUICK_WINDOW_S) if quick else (WARMUP_S, WINDOW_S)
    with tempfile.TemporaryDirectory(prefix="omrl-bench-scale-") as tmp:
        root = Path(tmp)
        model = str(init_tiny_model(root / "model"))
        points = [measure(root, model, n, arm, warmup_s, window_s) for n in loops_sweep for arm in ARMS]
    return report(points, loops_sweep)


def report(points: list[dict], loops_sweep: tuple[int, ...]) -> dict:
    at = {(p["loops"], p["arm"]): p for p in points}
    rows = []
    for n in loops_sweep:
        system, baseline = at[(n, "doorbell")], at[(n, "polling")]
        for key, measure in (("groups_per_s", "groups/s taken in"),
                             ("commands_per_group", "Redis commands per trained group (lower is better)"),
                             ("redis_cpu", "Redis CPU, cores (lower is better)")):
            rows.append({"measure": f"N={n} actor loops: {measure}, doorbell / polling", "system": system[key],
                         "baseline": baseline[key], "ratio": spread([system[key] / baseline[key]])})
    low, high = min(n for n in loops_sweep if n > 1), max(loops_sweep)
    door = {n: at[(n, "doorbell")] for n in loops_sweep}
    goals = {"commands_per_group_high_over_low": door[high]["commands_per_group"] / door[low]["commands_per_group"],
             "intake_high_over_low": door[high]["groups_per_s"] / door[low]["groups_per_s"],
             "redis_cpu_high": door[high]["redis_cpu"], "low": low, "high": high}
    goals["met"] = {"commands_flat": goals["commands_per_group_high_over_low"] <= 1.5,
                    "intake_kept": goals["intake_high_over_low"] >= 0.9, "redis_under_half_core": goals["redis_cpu_high"] < 0.5}
    return {"rows": rows, "points": points, "goals": goals,
            "settings": {"B": B, "eta": ETA, "step_s": STEP_S, "rate": RATE, "tokens": TOKENS, "processes": PROCESSES,
                         "max_tokens": MAX_TOKENS, "poll_s": POLL_S, "trainer_cap_groups_per_s": B / STEP_S}}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    figures = (("groups_per_s", "groups/s taken in"), ("commands_per_group", "Redis commands per trained group"),
               ("redis_cpu", "Redis CPU (cores)"), ("wait_p99_s", "admission wait p99 (s)"))
    for ax, (key, title) in zip(axes, figures):
        for arm in ARMS:
            pts = sorted((p["loops"], p[key]) for p in result["points"] if p["arm"] == arm)
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=arm)
        ax.set_xscale("log")
        if key in ("commands_per_group", "redis_cpu"):
            ax.set_yscale("log")
        ax.set_xlabel("actor group loops (N)")
        ax.set_title(title)
    axes[0].axhline(result["settings"]["trainer_cap_groups_per_s"], color="grey", linestyle=":", label="trainer's cap")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--actor"]:
        actor_main(sys.argv[2:])
    else:
        raise SystemExit("usage: omrl bench scale [--quick] [--out DIR]")
