"""`omrl run`, the embedded default: a Redis server of its own (unless redis.url is set),
the env server, N actor processes and the learner, all real processes on this machine.

The supervisor keeps the run alive: a process that exits is restarted (Redis on the same
port with the same data), and so is one alive but making no progress (its beat file,
common/liveness.py, older than `supervisor.hang_s`: killed first; the embedded Redis's beats
are the PINGs it answers), after a backoff that doubles with each restart, within a budget per
process (`supervisor.max_restarts` in any `supervisor.restart_window_s`); each restart
is logged with the last lines of the process's log. The run stops when the learner
finishes its steps (exit code 0), on Ctrl-C, or when a process has spent its budget, with
a message that names it. Each child runs in its own process group, killed as a whole, so
nothing is left behind (vLLM's engine processes included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from common.cli import config_from_args, log_config
from common.config import Config, SupervisorConfig, dump_toml
from common.files import write_atomic
from common.liveness import ENV as BEAT_ENV
from common.liveness import beat, die_with_parent, last_beat
from common.logs import setup_logging
from common.retry import wait_http

log = logging.getLogger("omrl.run")
STOP_TIMEOUT_S = 20.0
ROTATE_EVERY_S = 10.0  # how often the supervisor looks at the logs' sizes
PLOT_TIMEOUT_S = 300.0


class Process:
    """One supervised process: its command, its log file, its restarts. With `echo`, its
    output also goes to this process's stdout (the learner's one line per step). With
    `beat_path`, it touches that file while it makes progress (common/liveness.py)."""

    def __init__(self, name: str, args: list[str], log_path: Path, echo: bool = False,
                 ready: Callable[[Process], None] | None = None, env: dict[str, str] | None = None,
                 optional: bool = False, beat_path: Path | None = None):
        self.name, self.args, self.log_path, self.echo, self.ready = name, args, log_path, echo, ready
        self.env = env  # the environment it starts with (None: this process's)
        self.optional = optional  # when it cannot be kept up, the run goes on without it
        self.beat_path = beat_path
        self.hung: str | None = None  # why the supervisor killed this incarnation: it made no progress
        self.given_up = False
        self.proc: subprocess.Popen | None = None
        self.teeing: threading.Thread | None = None  # with echo: copies its output until it closes
        self.restarts: deque[float] = deque()  # monotonic times of restarts
        self.restart_at: float | None = None
        self.started_at = 0.0
        self.started_wall = 0.0  # time.time() of the start: beats older than it are a predecessor's
        self.starts = 0

    def start(self) -> None:
        env = self.env
        if self.beat_path is not None:
            self.beat_path.parent.mkdir(parents=True, exist_ok=True)
            env = {**(os.environ if env is None else env), BEAT_ENV: str(self.beat_path)}
        self.hung = None
        self.started_wall = time.time()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE if self.echo else out,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                         preexec_fn=die_with_parent)
        if self.echo:
            self.teeing = threading.Thread(target=self._tee, args=(self.proc.stdout,), daemon=True)
            self.teeing.start()
        self.starts += 1
        self.started_at = time.monotonic()
        if self.ready is not None:
            self.ready(self)

    def stalled(self, hang_s: float, start_grace_s: float) -> str | None:
        """Why this live process counts as hung (no beat within hang_s, or none yet start_grace_s
        after its start), or None."""
        if self.beat_path is None or not hang_s:
            return None
        now, at = time.time(), last_beat(self.beat_path)
        if at is None or at < self.started_wall:
            if now - self.started_wall > start_grace_s:
                return f"made no progress in the {now - self.started_wall:.0f}s since its start (supervisor.start_grace_s)"
            return None
        if now - at > hang_s:
            return f"made no progress for {now - at:.0f}s (supervisor.hang_s = {hang_s:g})"
        return None

    def describe_exit(self) -> str:
        """How it ended, and why the supervisor ended it where it did."""
        how = describe_exit(self.returncode)
        return f"{how} (the supervisor's: it {self.hung})" if self.hung else how

    def _tee(self, stream) -> None:
        with open(self.log_path, "ab") as out:
            for line in stream:
                out.write(line)
                out.flush()
                sys.stdout.buffer.write(line)
                sys.stdout.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait, then SIGKILL the whole process group."""
        stop_all([self], timeout)

    def rotate_log(self, max_bytes: int) -> bool:
        """Past `max_bytes`, the log is copied to NAME.log.1 and emptied in place (supervisor.log_max_mb)."""
        try:
            if not self.log_path.exists() or self.log_path.stat().st_size <= max_bytes:
                return False
            shutil.copyfile(self.log_path, self.log_path.with_name(self.log_path.name + ".1"))
            os.truncate(self.log_path, 0)
        except OSError as exc:  # a full disk, a log removed by hand: the run goes on, unrotated this time
            log.warning("could not rotate %s: %s", self.log_path, exc)
            return False
        return True

    def tail(self, lines: int = 20) -> str:
        if lines <= 0 or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])


def stop_all(processes: list[Process], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to every process group at once (with SIGCONT, so that a stopped process hears it),
    one wait of `timeout` for them all, then SIGKILL to what is left of each group: a hung process
    costs the timeout once, whatever the number of processes."""
    started = [p for p in processes if p.proc is not None]
    for p in started:
        p.signal(signal.SIGTERM)
        p.signal(signal.SIGCONT)
    deadline = time.monotonic() + timeout
    for p in started:
        try:
            p.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs: killing it", p.name, timeout)
        p.signal(signal.SIGKILL)
        p.proc.wait()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Restarts processes that exit, within their budgets. `check()` returns None while
    the run goes on, 0 when the learner finished, 1 when a budget is spent."""

    def __init__(self, cfg: SupervisorConfig, processes: list[Process], learner: Process | None):
        self.cfg, self.processes, self.learner = cfg, processes, learner
        self.failure: str | None = None  # why check() returned 1, in one line
        self.rotated_at = time.monotonic()  # the last look at the logs' sizes

    def rotate_logs(self, every_s: float = ROTATE_EVERY_S) -> None:
        """Every `every_s`, each log past supervisor.log_max_mb is rotated."""
        if not self.cfg.log_max_mb or time.monotonic() - self.rotated_at < every_s:
            return
        self.rotated_at = time.monotonic()
        for p in self.processes:
            if p.rotate_log(int(self.cfg.log_max_mb * 2 ** 20)):
                log.info("%s's log passed %g MB: the earlier part is in %s.1", p.name, self.cfg.log_max_mb, p.log_path)

    def backoff(self, process: Process) -> float:
        return min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** max(0, len(process.restarts) - 1))

    def check(self) -> int | None:
        self.rotate_logs()
        now = time.monotonic()
        for p in self.processes:
            if p.given_up:
                continue
            if p.restart_at is not None:
                if now >= p.restart_at:
                    p.restart_at = None
                    log.info("restarting %s (restart %d)", p.name, len(p.restarts))
                    p.start()
                continue
            code = p.returncode
            if code is None:
                hung = None if p.hung else p.stalled(self.cfg.hang_s, self.cfg.start_grace_s)
                if hung:
                    p.hung = hung
                    log.error("%s %s: killing it to restart it. Last lines of its log (%s):\n%s", p.name, p.hung,
                              p.log_path, p.tail(self.cfg.log_lines))
                    p.signal(signal.SIGKILL)  # a stopped process too; its exit is seen next
                continue
            p.signal(signal.SIGKILL)  # what it left behind in its process group
            if p is self.learner and code == 0:
                log.info("learner finished with exit code 0")
                return 0
            while p.restarts and now - p.restarts[0] > self.cfg.restart_window_s:
                p.restarts.popleft()
            first_start_failed = p.starts == 1 and now - p.started_at < self.cfg.start_s
            if self.cfg.restart == "never" or first_start_failed or len(p.restarts) >= self.cfg.max_restarts:
                why = ("supervisor.restart is never" if self.cfg.restart == "never" else
                       f"it failed {now - p.started_at:.0f}s after its first start (within supervisor.start_s: a "
                       f"configuration or installation problem, not retried)" if first_start_failed else
                       f"it used its restart budget ({len(p.restarts)} restarts in {self.cfg.restart_window_s:.0f}s, "
                       f"supervisor.max_restarts = {self.cfg.max_restarts})")
                if p.optional:
                    p.given_up = True
                    log.error("%s %s; the run goes on without it: %s. Last lines of its log (%s):\n%s", p.name,
                              p.describe_exit(), why, p.log_path, p.tail(self.cfg.log_lines))
                    continue
                log.error("%s %s; stopping the run: %s. Last lines of its log (%s):\n%s", p.name, p.describe_exit(),
                          why, p.log_path, p.tail(self.cfg.log_lines))
                self.failure = f"{p.name} {p.describe_exit()}, and {why}; its log: {p.log_path}"
                return 1
            p.restarts.append(now)
            delay = self.backoff(p)
            p.restart_at = now + delay
            log.warning("%s %s; restart %d of at most %d in %.0fs, in %.1fs. Last lines of its log (%s):\n%s",
                        p.name, p.describe_exit(), len(p.restarts), self.cfg.max_restarts,
                        self.cfg.restart_window_s, delay, p.log_path, p.tail(self.cfg.log_lines))
        return None


def _wait_http(url: str, timeout: float = 60.0) -> Callable[[Process], None]:
    def ready(process: Process) -> None:
        try:
            wait_http(url, timeout, process.proc.poll)
        except RuntimeError:
            pass  # exited: the supervisor sees it and decides
        except TimeoutError:
            log.error("%s did not answer %s within %.0fs: killing it", process.name, url, timeout)
            process.signal(signal.SIGKILL)  # the supervisor sees the exit and restarts it
    return ready


def _wait_redis(port: int) -> Callable[[Process], None]:
    def ready(process: Process) -> None:
        from broker.embedded import wait_until_up

        try:
            wait_until_up(port, process.proc)
        except RuntimeError:
            pass  # exited: the supervisor sees it and decides
        except TimeoutError as exc:
            log.error("%s: killing it", exc)
            process.signal(signal.SIGKILL)  # the supervisor sees the exit and restarts it
    return ready


def _probe_redis(port: int, beat_path: Path, stop: threading.Event, every_s: float = 1.0) -> None:
    """The embedded Redis's progress, for its beat file: each PING it answers within 2 s. A
    thread of the supervisor's, until `stop`; a stopped or wedged Redis stops its beats."""
    import redis as sync_redis

    client = sync_redis.Redis(port=port, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        while not stop.wait(every_s):
            try:
                client.ping()
            except sync_redis.RedisError:
                continue  # down, starting or hung: no beat
            beat(beat_path)
    finally:
        client.close()


def prepare(cfg: Config) -> Config:
    """Fill in what the embedded default provides: the tiny model, the env port, the weights' directory."""
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
    if not cfg.redis.url and cfg.weights.transport == "blob" and not cfg.weights.dir:
        # Every process is on this host: versions go to files, not through Redis and its append-only file.
        cfg.weights.dir = str((run_dir / "weights").resolve())
    return cfg


def evaluator_environment(cfg: Config) -> dict[str, str] | None:
    """The environment the evaluator starts with, or None where there is no evaluator: evaluation is
    off, or on GPUs, the learner's ranks and the actors leave it none (its engine would take
    actor.gpu_memory_utilization of a GPU that another engine or the learner already holds)."""
    if not cfg.learner.eval_every:
        return None
    from common.gpus import evaluator_devices

    devices = evaluator_devices(cfg)
    if devices is None:
        log.warning("no evaluator: the learner's %d rank(s) and %d actor(s) leave no GPU to its engine (one more "
                    "GPU starts it; learner.eval_every = 0 turns evaluation off)", cfg.learner.ranks,
                    cfg.actor.num_actors)
        return None
    if not devices:
        return dict(os.environ)
    log.info("the evaluator's engine uses GPU %s", devices)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": devices}


def learner_launcher(ranks: int) -> list[str]:
    """The learner as one process, or as `ranks` processes under torchrun on this machine
    (`--standalone`: its own rendezvous on a free port; rank 0 leads, see learner/worker.py)."""
    if ranks == 1:
        return []
    return ["torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0", "-m"]


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, {"learner.steps": args.steps or None, "run.run_dir": args.run_dir or None,
                                  "model.path": args.model or None})
    setup_logging("omrl", cfg.run.log_level)
    from deploy.preflight import require

    require(cfg, "run", args.debug)  # one line per problem and exit 2, before anything starts
    run_dir = Path(cfg.run.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    beats = run_dir / "liveness"  # each process's beat file (common/liveness.py)
    (run_dir / "redis").mkdir(exist_ok=True)
    cfg = prepare(cfg)

    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    redis: Process | None = None
    processes: list[Process] = []
    supervisor: Supervisor | None = None
    outcome: int | None = None
    plotting: threading.Thread | None = None
    probing = threading.Event()  # set: the Redis probe stops
    try:
        if not cfg.redis.url:
            from broker.embedded import EmbeddedRedis, free_port

            durable = cfg.redis.embedded_aof != "off"
            server = EmbeddedRedis(port=free_port(), appendonly=durable, data_dir=str((run_dir / "redis").resolve()),
                                   extra_args=["--appendfsync", cfg.redis.embedded_aof] if durable else [])
            redis = Process("redis", server.command(), logs / "redis.log", ready=_wait_redis(server.port),
                            beat_path=beats / "redis")
            redis.start()
            threading.Thread(target=_probe_redis, args=(server.port, beats / "redis", probing), name="redis-probe",
                             daemon=True).start()
            if not redis.alive():
                raise SystemExit(f"error: redis-server {describe_exit(redis.returncode)}:\n{redis.tail()}")
            cfg.redis.url = server.url
            log.info("embedded redis-server (%s) on %s%s", server.binary, server.url,
                     f", append-only file in {run_dir / 'redis'} (fsync {cfg.redis.embedded_aof})" if durable else
                     " (no persistence, redis.embedded_aof = \"off\": if it restarts, the groups it held are lost)")
            processes.append(redis)
        config_path = run_dir / "config.toml"
        config_path.write_text(dump_toml(cfg))
        log_config(cfg)
        py = [sys.executable, "-m"]
        cfg_args = ["--config", str(config_path)]
        if not cfg.env.url:
            env = Process("env-server", [*py, "envs", *cfg_args], logs / "env.log",
                          ready=_wait_http(cfg.env.base_url + "/"), beat_path=beats / "env-server")
            env.start()
            processes.append(env)
            if not env.alive():
                raise SystemExit(f"error: the env server {describe_exit(env.returncode)}:\n{env.tail()}")
            log.info("env server %r on %s", cfg.env.name, cfg.env.base_url)
        learner = Process("learner", [*py, *learner_launcher(cfg.learner.ranks), "learner", *cfg_args],
                          logs / "learner.log", echo=True, beat_path=beats / "learner")
        processes.append(learner)
        processes += [Process(f"actor{i}", [*py, "actors", *cfg_args, "--index", str(i)], logs / f"actor{i}.log",
                              beat_path=beats / f"actor{i}") for i in range(cfg.actor.num_actors)]
        evaluator_env = evaluator_environment(cfg)
        if evaluator_env is not None:  # its own engine: evaluations hold up no actor and no update
            processes.append(Process("evaluator", [*py, "actors", *cfg_args, "--evaluator"], logs / "evaluator.log",
                                     env=evaluator_env, optional=True, beat_path=beats / "evaluator"))
        for p in processes:
            if p.proc is None:
                p.start()
        log.info("started %d actors%s (logs in %s); the learner prints one line per step; restarts: %s, at most %d "
                 "per process in %.0fs", cfg.actor.num_actors,
                 f" and the evaluator ({cfg.learner.eval_tasks} held-out tasks every {cfg.learner.eval_every} versions)"
                 if evaluator_env is not None else "", logs, cfg.supervisor.restart, cfg.supervisor.max_restarts,
                 cfg.supervisor.restart_window_s)
        supervisor = Supervisor(cfg.supervisor, processes, learner)
        plotted = time.monotonic()  # the plot is drawn in a thread: the checks go on meanwhile
        while not stopping and outcome is None:
            outcome = supervisor.check()
            time.sleep(0.2)
            if (cfg.run.plot_every_s and time.monotonic() - plotted >= cfg.run.plot_every_s
                    and (plotting is None or not plotting.is_alive()) and (run_dir / "metrics.jsonl").exists()):
                plotted = time.monotonic()
                plotting = threading.Thread(target=_plot, args=(run_dir, True), name="plot", daemon=True)
                plotting.start()
        if stopping:
            log.info("interrupted: stopping every process")
            outcome = 130
    finally:
        # The actors (and the evaluator) first, while the env server they talk to is up; then the
        # learner and the env server; Redis last.
        playing = [p for p in processes if p.name.startswith("actor") or p.name == "evaluator"]
        stop_all(playing)
        stop_all([p for p in processes if p is not redis and p not in playing])
        if cfg.redis.url and (redis is None or redis.alive()):
            _report(cfg, run_dir)
        if redis is not None:
            probing.set()
            redis.stop()
        if plotting is not None:
            plotting.join(timeout=60)
        if (run_dir / "metrics.jsonl").exists():
            _plot(run_dir)
    if supervisor is not None and supervisor.failure:
        log.error("the run stopped: %s", supervisor.failure)  # the last line says why
    return outcome


def _report(cfg: Config, run_dir: Path) -> None:
    """The run's accounting, logged and written to RUN_DIR/accounting.json."""
    from broker.status import format_accounting, status_of

    try:
        groups = asyncio.run(status_of(cfg.redis))["groups"]
    except Exception as exc:  # noqa: BLE001 - a report must not hide how the run ended
        log.warning("could not read the run's accounting from Redis: %s", exc)
        return
    write_atomic(run_dir / "accounting.json", json.dumps(groups, indent=2) + "\n")
    log.info("%s", format_accounting(groups))


def _plot(run_dir: Path, quiet: bool = False) -> None:
    """RUN_DIR/metrics.png from what metrics.jsonl holds now (while the run goes on: `quiet`),
    drawn by `omrl plot` in a process of its own: a supervisor that drew every few minutes
    for hours grew by megabytes a plot (the soak, docs/results/benchmarks.md)."""
    try:
        done = subprocess.run([sys.executable, "-m", "deploy.cli", "plot", str(run_dir)], capture_output=True,
                              text=True, timeout=PLOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("no plot written: omrl plot took over %.0fs", PLOT_TIMEOUT_S)
        return
    if done.returncode == 0:
        (log.debug if quiet else log.info)("plots of reward, throughput and staleness: %s", done.stdout.strip())
    else:  # a plot must not hide how the run ended; matplotlib missing is said once, at the end
        (log.debug if quiet else log.warning)("no plot written: %s", (done.stderr.strip() or "?").splitlines()[-1])
