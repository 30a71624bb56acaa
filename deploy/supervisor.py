"""`omrl run`, the embedded default: a Redis server of its own (unless redis.url is set),
the env server, N actor processes and the learner, all real processes on this machine.
Stops when the learner finishes its steps, on Ctrl-C, or when any process dies, and
leaves no process behind (each child runs in its own process group, killed by pid)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.cli import config_from_args, log_config
from common.config import Config, dump_toml
from common.logs import setup_logging

log = logging.getLogger("omrl.run")
STOP_TIMEOUT_S = 20.0


class Child:
    def __init__(self, name: str, args: list[str], log_path: Path | None):
        self.name = name
        out = open(log_path, "ab") if log_path else None
        self.log_path = log_path
        self.proc = subprocess.Popen(args, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True)
        if out:
            out.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _wait_http(url: str, child: Child, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{child.name} did not answer {url} within {timeout}s")


def stop_all(children: list[Child], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop in reverse start order (actors before the env server they talk to): SIGTERM,
    wait, then SIGKILL the whole process group (vLLM's engine processes too)."""
    for child in reversed(children):
        child.signal(signal.SIGTERM)
        try:
            child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs: killing it", child.name, timeout)
        child.signal(signal.SIGKILL)
        child.proc.wait()


def prepare(cfg: Config) -> Config:
    """Fill in what the embedded default provides: the tiny model, the env port."""
    from broker.embedded import free_port

    run_dir = Path(cfg.run.run_dir)
    if not cfg.model.path:
        from common.models import init_tiny_model, is_model_dir

        model_dir = run_dir / "model"
        if not is_model_dir(model_dir):
            log.info("building the tiny model in %s", model_dir)
            init_tiny_model(model_dir)
        cfg.model.path = str(model_dir.resolve())
    if not cfg.env.url and cfg.env.port == 0:
        cfg.env.port = free_port(cfg.env.host)
    return cfg


def run(args: argparse.Namespace) -> int:
    extra = []
    if args.steps:
        extra.append(f"learner.steps={args.steps}")
    if args.run_dir:
        extra.append(f"run.run_dir={json.dumps(args.run_dir)}")
    if args.model:
        extra.append(f"model.path={json.dumps(args.model)}")
    cfg = config_from_args(args, extra)
    setup_logging("omrl", cfg.run.log_level)
    run_dir = Path(cfg.run.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "redis").mkdir(exist_ok=True)
    cfg = prepare(cfg)

    redis = None
    children: list[Child] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not cfg.redis.url:
            from broker.embedded import EmbeddedRedis

            aof = ["--appendfsync", "always"] if cfg.redis.embedded_aof else []
            redis = EmbeddedRedis(appendonly=cfg.redis.embedded_aof, data_dir=str((run_dir / "redis").resolve()),
                                  extra_args=aof).start()
            cfg.redis.url = redis.url
            log.info("embedded redis-server (%s) on %s", redis.binary, redis.url)
        config_path = run_dir / "config.toml"
        config_path.write_text(dump_toml(cfg))
        log_config(cfg)
        py = [sys.executable, "-m"]
        cfg_args = ["--config", str(config_path)]
        if not cfg.env.url:
            env = Child("env-server", [*py, "envs", *cfg_args], run_dir / "logs" / "env.log")
            children.append(env)
            _wait_http(cfg.env.base_url + "/", env)
            log.info("env server %r on %s", cfg.env.name, cfg.env.base_url)
        learner = Child("learner", [*py, "learner", *cfg_args], None)
        children.append(learner)
        for i in range(cfg.actor.num_actors):
            children.append(Child(f"actor{i}", [*py, "actors", *cfg_args, "--index", str(i)],
                                  run_dir / "logs" / f"actor{i}.log"))
        log.info("started %d actors (logs in %s); the learner prints one line per step",
                 cfg.actor.num_actors, run_dir / "logs")
        while not stopping:
            if not learner.alive():
                break
            dead = [c for c in children if not c.alive()]
            if dead:
                c = dead[0]
                log.error("%s exited with %s; stopping the run. Last lines of its log:\n%s",
                          c.name, c.proc.returncode, c.tail())
                return 1
            time.sleep(0.5)
        if stopping:
            log.info("interrupted: stopping every process")
            return 130
        log.info("learner finished with exit code %d", learner.proc.returncode)
        _plot(run_dir)
        return learner.proc.returncode
    finally:
        stop_all(children)
        if redis is not None:
            redis.stop()


def _plot(run_dir: Path) -> None:
    from deploy.plots import plot_metrics

    try:
        path = plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
        log.info("plots of reward, throughput and staleness: %s", path)
    except ImportError:
        log.info("matplotlib is not installed: no plot written")
