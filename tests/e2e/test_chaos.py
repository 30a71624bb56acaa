"""Chaos through `omrl run`: real processes are stopped or killed one at a time, mid-run, and
the run must still reach its step count, exit 0 and account for every group.

One run (publish_every = 2, supervisor.hang_s = 20, the embedded Redis's append-only file
fsynced before every answer, otherwise the defaults: weight versions in RUN_DIR/weights) takes, in
turn: SIGSTOP of an actor, of the env server and of the learner (alive but hung: the
supervisor must see that they make no progress, kill them within hang_s and restart them),
SIGKILL of the Redis server, then SIGTERM of an actor. Each fault lands a random time after a
random step (the seed is printed), and the next one waits until the system has recovered
from it. Afterwards the
test reopens the run's Redis data and checks the books from the raw streams: every group
started was produced, failed with a reason, or is still running; every group produced was
trained (exactly once), dead-lettered, or is waiting in a stream.
"""

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.connection import connect
from broker.embedded import EmbeddedRedis, find_redis_server
from broker.keys import Keys
from common.messages import decode_group
from common.metrics import last_step, read_jsonl
from tests.budget import patience
from tests.procs import cmdline, processes_mentioning

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]

# About 1.2 steps/s on 2 cores; a restarted actor needs 60-90 s (vLLM's start) to produce again.
# The last fault lands near step 110 (2026-12-04: about 110 in a 260-step run, which then trained
# 150 steps more for nothing, and 115 in a 190-step one); the test fails if the run ends before it.
STEPS, B = 190, 8
HANG_S = 20  # supervisor.hang_s: a stopped process is killed and restarted this long after its last beat
FAILURE_REASONS = {"actor_lost", "env_unreachable", "env_error", "env_timeout", "cancelled"}


class ChaosRun:
    def __init__(self, run_dir: Path, seed: int):
        self.run_dir = run_dir
        self.rng = random.Random(seed)
        self.out = open(run_dir.parent / "omrl.out", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir), "--steps", str(STEPS),
             "--set", "learner.publish_every=2", "--set", f"supervisor.hang_s={HANG_S}",
             "--set", "learner.eval_every=0",  # the evaluator's faults: tests/e2e/test_omrl_run.py
             # With "everysec", Redis answers while a background fsync holds back its write (up to 2 s),
             # so a SIGKILL can lose answered changes (likely: tickets actors hold, whose groups then show
             # as unaccounted; CI, 2026-11-28: -3). "always" writes before every answer: nothing is lost.
             "--set", 'redis.embedded_aof="always"'],
            stdout=self.out, stderr=subprocess.STDOUT, text=True)
        self.events: list[str] = []

    def output(self) -> str:
        return Path(self.out.name).read_text(errors="replace")

    def steps(self) -> int:
        return last_step(self.run_dir)

    def wait(self, condition, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"omrl run ended while waiting for {what}:\n{self.output()[-5000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.output()[-5000:]}"
            time.sleep(0.2)

    def config(self) -> dict:
        return tomllib.loads((self.run_dir / "config.toml").read_text())

    def redis_port(self) -> int:
        return int(self.config()["redis"]["url"].rsplit(":", 1)[1].split("/")[0])

    def pid(self, pattern: str) -> int:
        """The pid of the one process whose command line matches `pattern`."""
        pids = [pid for pid in processes_mentioning("") if re.search(pattern, cmdline(pid))]
        assert len(pids) == 1, (pattern, [(cmdline(p)) for p in pids])
        return pids[0]

    def fault(self, name: str, pattern: str, sig: int, after_steps: int, ready=None) -> int:
        """Wait a random 0-3 steps more, then a random fraction of a step (then until `ready()`), then signal."""
        self.wait(lambda: self.steps() >= after_steps + self.rng.randrange(4), f"step {after_steps}")
        time.sleep(self.rng.random() * 1.5)
        if ready is not None:
            self.wait(ready, f"{name} ready for its fault")
        pid = self.pid(pattern)
        step = self.steps()
        os.kill(pid, sig)
        self.events.append(f"{signal.Signals(sig).name} {name} (pid {pid}) at step {step}")
        print(self.events[-1], flush=True)
        return step

    def _read(self, read):
        """`read(client, keys)` against the run's Redis; None while it is unreachable."""
        async def run():
            client = connect(self.config()["redis"]["url"])
            try:
                return await read(client, Keys(self.config()["redis"]["run"]))
            finally:
                await client.aclose()
        try:
            return asyncio.run(run())
        except (OSError, RedisConnectionError):
            return None

    def member(self, index: int) -> dict | None:
        members = self._read(_members) or []
        return next((m for m in members if m["id"].endswith(f"-{index}")), None)

    def tickets_held_by(self, index: int) -> int:
        """Admission tickets (`name|incarnation|n`) held now by actor `index`'s processes."""
        async def held(client, keys):
            return [t.decode() for t in await client.zrange(keys.tickets_held, 0, -1)]
        return sum(t.split("|", 1)[0].endswith(f"-{index}") for t in self._read(held) or [])

    def actor_back(self, index: int, old_pid: int) -> bool:
        """The successor heartbeats, on a version newer than the first, and has produced."""
        m = self.member(index)
        return m is not None and m["pid"] != old_pid and m["groups"] > 0 and m["version"] >= 1


async def _members(client, keys) -> list[dict]:
    from broker.membership import Membership

    return await Membership(client, keys).members(dead_after_s=3600)


def read_books(redis_dir: Path, run: str) -> dict:
    """Reopen the run's Redis data (its append-only file) and read the raw streams and counters."""
    with EmbeddedRedis(binary=find_redis_server(), appendonly=True, data_dir=str(redis_dir)) as server:
        async def read():
            client = connect(server.url)
            keys = Keys(run)
            try:
                waiting = [decode_group(f[b"g"]).group_id for _, f in await client.xrange(keys.rollouts())]
                dead = [(f[b"reason"].decode(), f[b"data"]) for _, f in await client.xrange(keys.dead_letters)]
                counts = {k.decode(): int(v) for k, v in (await client.hgetall(keys.counts)).items()}
                held = await client.zcard(keys.tickets_held)
            finally:
                await client.aclose()
            return {"waiting": waiting, "dead": dead, "counts": counts, "held": held}
        return asyncio.run(read())


@pytest.mark.timeout(patience(180))
def test_every_process_can_die_and_the_run_finishes_with_every_group_accounted_for(tmp_path):
    seed = random.randrange(10_000)
    print(f"chaos seed {seed}")
    run_dir = tmp_path / "run"
    chaos = ChaosRun(run_dir, seed)
    try:
        chaos.wait(lambda: chaos.steps() >= 1, "the first step", timeout=400)
        cfg_pattern = re.escape(str(run_dir / "config.toml"))

        # 1. SIGSTOP an actor: alive, hung; killed within hang_s; its successor returns its tickets and
        # starts on the current weights.
        victim = chaos.rng.randrange(2)
        old = chaos.pid(rf"-m actors --config {cfg_pattern} --index {victim}\b")
        # It is killed while it holds tickets (an actor waiting for admission may hold none);
        # those it still holds once dead are the ones that must come back as actor_lost.
        chaos.fault(f"actor{victim}", rf"-m actors --config {cfg_pattern} --index {victim}\b", signal.SIGSTOP, 4,
                    ready=lambda: chaos.tickets_held_by(victim) > 0)
        lost = chaos.tickets_held_by(victim)
        print(f"actor{victim} stopped holding {lost} tickets", flush=True)
        chaos.wait(lambda: chaos.actor_back(victim, old), f"actor{victim} back and producing")

        # 2. SIGSTOP the env server: killed within hang_s; groups in flight fail with a reason, actors wait
        # and go on.
        at = chaos.fault("env server", rf"-m envs --config {cfg_pattern}", signal.SIGSTOP, chaos.steps() + 2)
        chaos.wait(lambda: chaos.steps() >= at + 4, "4 steps after the env server's restart")

        # 3. SIGSTOP the learner mid-batch: killed within hang_s; it resumes from its checkpoint, re-reads
        # its pending groups.
        at = chaos.fault("learner", rf"-m learner --config {cfg_pattern}", signal.SIGSTOP, chaos.steps() + 2)
        chaos.wait(lambda: chaos.steps() >= at + 4, "4 steps after the learner's restart")

        # 4. SIGKILL Redis: restarted on the same port from its append-only file (the default's, fsync
        # every second: a killed server has written every reply's change to it); nothing is lost.
        port = chaos.redis_port()
        at = chaos.fault("redis", rf"redis-server 127\.0\.0\.1:{port}\b", signal.SIGKILL, chaos.steps() + 2)
        chaos.wait(lambda: chaos.steps() >= at + 4, "4 steps after Redis's restart")

        # 5. SIGTERM an actor: it drains, flushes, returns its tickets, exits; it is restarted.
        victim = chaos.rng.randrange(2)
        restarts = chaos.output().count(f"restarting actor{victim} ")
        chaos.fault(f"actor{victim}", rf"-m actors --config {cfg_pattern} --index {victim}\b", signal.SIGTERM,
                    chaos.steps() + 2)
        chaos.wait(lambda: chaos.output().count(f"restarting actor{victim} ") > restarts, f"actor{victim}'s restart")
        assert chaos.steps() < STEPS, "the run ended before the last fault: raise STEPS"

        assert chaos.proc.wait(600) == 0, chaos.output()[-5000:]
    finally:
        if chaos.proc.poll() is None:
            chaos.proc.send_signal(signal.SIGINT)
            chaos.proc.wait(120)
    out = chaos.output()
    print("\n".join(chaos.events))
    print("\n".join(line for line in out.splitlines() if "omrl.run" in line and ("restart" in line or "groups:" in line)))

    # Each fault was seen and answered by a restart; each hung process within hang_s of its last beat.
    hung = r"was killed by SIGKILL \(the supervisor's: it made no progress for (\d+)s \(supervisor.hang_s = 20\)\)"
    for name, how in (("actor", hung), ("env-server", hung), ("learner", hung), ("redis", "was killed by SIGKILL"),
                      ("actor", "exited with code 0")):
        assert re.search(rf"{name}\d? {how}; restart \d of at most", out), (name, how)
    assert all(HANG_S <= int(s) <= HANG_S + 5 for s in re.findall(hung, out)), re.findall(hung, out)
    # The env server's death cost groups, not actors: only the two actor faults restarted one.
    assert len(re.findall(r"omrl\.run: actor\d (?:was killed|exited)", out)) == 2

    # The run reached its step count; no group was trained twice.
    last = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(last) == list(range(1, STEPS + 1))
    trained = [gid for s in range(1, STEPS + 1) for gid in last[s]["batch/group_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * B

    # The books, from the raw streams: started = produced + failed + running, and
    # produced = trained + dead-lettered + waiting (copies a retried XADD wrote aside).
    books = read_books(run_dir / "redis", chaos.config()["redis"]["run"])
    counts = books["counts"]
    failed = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("failed:") and v}
    assert set(failed) <= FAILURE_REASONS, failed
    assert lost >= 1 and failed.get("actor_lost", 0) >= lost  # the SIGKILLed actor's tickets came back
    assert counts["started"] == counts["produced"] + sum(failed.values()) + books["held"]
    dead_ids = [decode_group(data).group_id for reason, data in books["dead"] if reason == "stale"]
    assert len(dead_ids) == len(books["dead"])  # only ever stale groups; no garbage was produced
    waiting = set(books["waiting"]) - set(trained)
    assert not set(dead_ids) & set(trained) and not waiting & set(dead_ids)
    assert counts["produced"] == len(trained) + len(dead_ids) + len(waiting)
    assert processes_mentioning(str(run_dir)) == []
