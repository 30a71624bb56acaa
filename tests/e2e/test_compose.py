"""`docker compose` for real: the images built on this machine from Debian's packages (no
registry), `up` with 2 actors, a third added while the learner trains and, while it starts,
one of the first two actors' processes SIGKILLed (Docker's restart policy brings it back as
itself; the two vLLM starts overlap, one wait fewer), and one replica removed by scaling
down. Then the learner's container is replaced with a step count a little past
where it is (it resumes from its checkpoint on the runs volume): it must reach that count
and exit 0 with every group accounted for, and the replicas must have had distinct
identities (names, indexes, seeds). The learner runs open-ended until then, because how
long a replica takes to start vLLM on 2 busy cores varies by minutes.

Which actor is killed and when is drawn from a seed that the test prints. Needs a Docker
engine and compose (`bash deploy/docker/engine.sh` installs and starts them as root; CI
runs it); skips and says why elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from broker.connection import connect
from broker.keys import Keys
from broker.membership import Membership
from broker.status import format_accounting, status_of
from common.config import RedisConfig
from tests.budget import patience

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
OPEN_ENDED = 100_000  # the learner's step count until the events are done
MORE_STEPS = 10  # then: where it is, plus these
CALL_S = 600  # the most one compose command may take
FAILURE_REASONS = {"actor_lost", "cancelled"}  # a killed replica's groups, a removed one's


def compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def why_no_docker() -> str | None:
    if not shutil.which("docker"):
        return "no docker command (bash deploy/docker/engine.sh installs an engine as root)"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine answers (bash deploy/docker/engine.sh starts one as root)"
    if compose_command() is None:
        return "no docker compose (bash deploy/docker/engine.sh installs docker-compose)"
    if not shutil.which("debootstrap"):
        return "no debootstrap for the local base image (apt-get install debootstrap)"
    return None


class Compose:
    """One compose project on the repo's compose file, its Redis published on a free
    loopback port for the test to read the run's books."""

    def __init__(self, tmp: Path, config: str):
        self.name = f"omrl-e2e-{uuid.uuid4().hex[:8]}"
        (tmp / "run.toml").write_text(config)
        self.override = tmp / "override.yml"
        self.set_steps(OPEN_ENDED)
        self.cmd = [*compose_command(), "-p", self.name, "-f", str(ROOT / "docker-compose.yml"), "-f",
                    str(self.override)]
        self.env = {**os.environ, "OMRL_CONFIG": str(tmp / "run.toml"), "OMRL_REDIS_IMAGE": "omrl-redis:7",
                    "COMPOSE_PROFILES": "cpu", "OMRL_EVAL_EVERY": "0",  # the evaluator: tests/e2e/test_omrl_run.py
                    # docker-compose's wait on the engine (60 s by default) ran out creating the actors
                    # while the other test worker kept the machine busy; the call's timeout bounds it.
                    "COMPOSE_HTTP_TIMEOUT": str(CALL_S - 60)}
        self.t0 = time.monotonic()
        self.timeline: list[str] = []

    def __call__(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run([*self.cmd, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=CALL_S)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def set_steps(self, steps: int) -> None:
        """Redis on a free loopback port; at most a core for each actor and the learner (a
        replica starting vLLM gets its share of the cores beside the busy ones, and a whole one
        when they wait); the learner's step count."""
        self.override.write_text(
            'services:\n  redis:\n    ports: ["127.0.0.1::6379"]\n  actor:\n    cpus: 1.0\n'
            f'  learner:\n    cpus: 1.0\n    environment:\n      OMRL_LEARNER__STEPS: "{steps}"\n')

    def note(self, text: str) -> None:
        line = f"{time.monotonic() - self.t0:6.1f}s  {text}"
        self.timeline.append(line)
        print(line, flush=True)

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()

    def inspect(self, container: str, fmt: str) -> str:
        return subprocess.run(["docker", "inspect", "-f", fmt, container], capture_output=True, text=True,
                              check=True).stdout.strip()

    def redis(self) -> RedisConfig:
        host_port = self("port", "redis", "6379").strip().rsplit(":", 1)[1]
        return RedisConfig(url=f"redis://127.0.0.1:{host_port}/0")


def read(cfg: RedisConfig) -> tuple[dict, dict[str, int]]:
    async def both():
        client = connect(cfg)
        try:
            return await status_of(cfg), await Membership(client, Keys(cfg.run, cfg.shards)).slots()
        finally:
            await client.aclose()
    return asyncio.run(both())


def test_compose_scales_kills_and_accounts(tmp_path):
    reason = why_no_docker()
    if reason:
        pytest.skip(reason)
    start = time.monotonic()
    build = subprocess.run(["bash", "deploy/docker/build.sh"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "OMRL_BASE_IMAGE": "local"}, timeout=patience(240))
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"images built in {time.monotonic() - start:.0f} s: {build.stdout.strip().splitlines()[-1]}")

    seed = int(os.environ.get("OMRL_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    print(f"seed {seed} (OMRL_TEST_SEED={seed} repeats this run's choices)")
    run = Compose(tmp_path, "[actor]\nconcurrent_groups = 2\n")
    seen: dict[tuple[str, int], dict] = {}  # (actor name, start) -> its heartbeat record

    def status() -> dict:
        current, slots = read(redis)
        for member in current["members"]:
            if member.get("role") == "actor":
                seen[(member["id"], member["start"])] = member
        current["slots"] = slots
        return current

    # For each event: a replica's vLLM start takes minutes when the other test worker
    # (pytest-xdist) keeps the machine busy too (over 10 in one CI run).
    def wait(condition, what: str, timeout: float = patience(150)) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            current = status()
            if condition(current):
                run.note(f"{what} (learner step {step_of(current)})")
                return current
            learner = run.containers("learner")
            if learner and run.inspect(learner[0], "{{.State.Status}}") == "exited":
                raise AssertionError(f"the learner exited before: {what}\n{run('logs', '--tail=40', 'learner')}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for: {what}\n{run('logs', '--tail=40')}")
            time.sleep(1.0)

    def live_actors(current: dict) -> list[dict]:
        return [m for m in current["members"] if m.get("role") == "actor" and m["alive"]]

    try:
        run("up", "-d", "--no-build", "--scale", "actor=2")
        run.note("up: redis, env, init-model, learner, 2 actors")
        redis = run.redis()
        first = wait(lambda s: step_of(s) >= 3 and len(live_actors(s)) == 2 and all(m["groups"] > 0 for m in live_actors(s)),
                     "learner trains on the first 2 actors, both producing")

        run("up", "-d", "--no-build", "--no-recreate", "--scale", "actor=3", "actor")
        run.note("scaled to 3 actors")
        before = rng.choice(sorted(live_actors(first), key=lambda m: m["id"]))  # one of the first two
        victim = before["id"]
        victim_container = next(c for c in run.containers("actor") if run.inspect(c, "{{.Config.Hostname}}") == victim)
        time.sleep(rng.uniform(0, 20))  # somewhere in the third replica's start
        os.kill(int(run.inspect(victim_container, "{{.State.Pid}}")), signal.SIGKILL)
        run.note(f"SIGKILL to actor {victim} (index {before['index']}) while the third starts")
        three = wait(lambda s: len(live_actors(s)) == 3 and all(m["groups"] > 0 for m in live_actors(s))
                     and any(m["id"] == victim and m["start"] == 2 for m in live_actors(s)),
                     f"the third actor joined and actor {victim}, restarted by Docker, came back: all 3 produced")
        actors = live_actors(three)
        assert sorted(m["index"] for m in actors) == [0, 1, 2], actors  # distinct: no index in the compose file
        assert len({m["seed"] for m in actors}) == 3 and len({m["id"] for m in actors}) == 3, actors
        assert int(run.inspect(victim_container, "{{.RestartCount}}")) >= 1
        again = next(m for m in actors if m["id"] == victim)
        assert again["index"] == before["index"] and again["seed"] != before["seed"], (before, again)

        run("up", "-d", "--no-build", "--no-recreate", "--scale", "actor=2", "actor")
        remaining = {run.inspect(c, "{{.Config.Hostname}}") for c in run.containers("actor")}
        removed = {m["id"] for m in actors} - remaining
        assert len(removed) == 1, (removed, remaining)
        run.note(f"scaled down to 2: actor {next(iter(removed))} removed")
        wait(lambda s: not removed & {m["id"] for m in s["members"]} and not removed & set(s["slots"]),
             "the removed actor left cleanly (membership and slot freed)")

        steps = step_of(status()) + MORE_STEPS
        run.set_steps(steps)
        run("up", "-d", "--no-build", "--no-deps", "learner")  # SIGTERM: it commits, then its successor resumes
        run.note(f"learner replaced, to stop at step {steps}")
        learner = run.containers("learner")[0]
        deadline = time.monotonic() + patience(120)
        while run.inspect(learner, "{{.State.Status}}") != "exited":
            assert time.monotonic() < deadline, run("logs", "--tail=40", "learner")
            time.sleep(2)
        assert run.inspect(learner, "{{.State.ExitCode}}") == "0", run("logs", "--tail=40", "learner")
        run("stop", "actor")  # SIGTERM: in-flight groups come back as cancelled, buffered ones are flushed
        (evaluator,) = run("ps", "-a", "-q", "evaluator").split()  # evaluation off: it exited 0 and stayed down
        assert run.inspect(evaluator, "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}") == "exited 0 0"
        final = status()
        run.note(f"learner exited 0 at step {step_of(final)}; actors stopped")
    finally:
        logs = run("logs", "--no-color", check=False)
        (tmp_path / "compose.log").write_text(logs)
        run("down", "-v", "--remove-orphans", check=False)

    groups = final["groups"]
    print(format_accounting(groups))
    assert final["learner"]["step"] == steps
    assert groups["started"] == groups["produced"] + sum(groups["failed"].values()) + groups["held"]
    assert groups["held"] == 0 and groups["unaccounted"] == 0 and not groups["dead_lettered"], groups
    assert set(groups["failed"]) <= FAILURE_REASONS, groups["failed"]
    assert groups["trained"] == steps * 8 and groups["produced"] == groups["trained"] + groups["waiting"]
    # Four processes ran: three replicas, one of them twice, each with its own seed.
    assert len(seen) == 4 and len({record["seed"] for record in seen.values()}) == 4, seen


def step_of(status: dict) -> int:
    return status["learner"]["step"] if status["learner"] else 0
