"""Real Redis set-ups for tests: a local Redis Cluster on loopback ports, and a TLS server
with a password and an ACL user, certificates made on the spot with openssl."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from broker.embedded import EmbeddedRedis, find_redis_server, free_port

SLOTS = 16384


def redis_binaries() -> list[str]:
    """The bundled redis-server (6.2) and, where there is one, the one on PATH (7.x on CI)."""
    bundled = find_redis_server("bundled")
    path = shutil.which("redis-server")
    return [bundled] + ([path] if path and os.path.realpath(path) != os.path.realpath(bundled) else [])


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(1000):
        port = random.randrange(20000, 45000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


@contextlib.contextmanager
def local_cluster(binary: str, workdir: Path, nodes: int = 3) -> Iterator[list[int]]:
    """`nodes` masters (cluster-enabled redis-server processes) sharing the 16384 slots."""
    servers = []
    try:
        for i in range(nodes):
            d = workdir / f"node{i}"
            d.mkdir(parents=True)
            servers.append(EmbeddedRedis(binary=binary, port=cluster_port(), data_dir=str(d), extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", "2000"]).start())
        clients = [redis.Redis(port=s.port) for s in servers]
        per = SLOTS // nodes
        for i, c in enumerate(clients):
            hi = SLOTS if i == nodes - 1 else (i + 1) * per
            c.execute_command("CLUSTER ADDSLOTS", *range(i * per, hi))
        for c in clients[1:]:
            c.execute_command("CLUSTER MEET", "127.0.0.1", servers[0].port)
        deadline = time.monotonic() + 30
        while not all(c.cluster("info").get("cluster_state") in ("ok", b"ok") for c in clients):
            if time.monotonic() > deadline:
                raise TimeoutError("local cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        for c in clients:
            c.close()
        yield [s.port for s in servers]
    finally:
        for s in servers:
            s.stop()


def has_tls(binary: str) -> bool:
    out = subprocess.run(["strings", binary], capture_output=True, text=True).stdout if shutil.which("strings") else ""
    return "tls-cert-file" in out


def make_certs(d: Path) -> dict[str, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-subj",
        "/CN=omrl-test-ca", "-days", "1")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.crt", "-days", "1", "-extfile", "san.ext")
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}


@contextlib.contextmanager
def tls_acl_server(binary: str, workdir: Path, user: str, password: str) -> Iterator[int]:
    """A server that speaks TLS on the returned port, requires a password for the default
    user and knows an ACL user limited to the omrl:* keys and channels."""
    certs = make_certs(workdir)
    tls_port = free_port()
    server = EmbeddedRedis(binary=binary, data_dir=str(workdir), extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs["cert"]), "--tls-key-file", str(certs["key"]),
        "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no",
        "--requirepass", "admin-secret",
        "--user", f"{user}", "on", f">{password}", "~omrl:*", "&omrl:*", "+@all", "-@dangerous"]).start()
    try:
        yield tls_port
    finally:
        server.stop()


@contextlib.contextmanager
def env_server_process(env: str, *settings: str) -> Iterator[str]:
    """`omrl env-server --env ENV` as its own process on a free port; yields its URL."""
    import sys

    port = free_port()
    args = [sys.executable, "-m", "deploy.cli", "env-server", "--env", env, "--port", str(port)]
    for setting in settings:
        args += ["--set", setting]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while http_json("GET", url) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"env server for {env} did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def http_json(method: str, url: str, body: dict | None = None) -> tuple[int, object] | None:
    """(status, JSON answer) of one request, or None when nothing listens at `url`."""
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except (ConnectionError, urllib.error.URLError):
        return None


def post_ok(url: str, path: str, body: dict) -> dict:
    """POST to an env server; the JSON answer, which must be a 200."""
    status, answer = http_json("POST", url + path, body)
    assert status == 200, (path, body, status, answer)
    return answer


def oracle_eval(env: str, url: str, episodes: int, *settings: str, timeout: float = 300) -> dict:
    """`omrl eval --policy oracle` against the server at `url`: its JSON result."""
    import json
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        args = [sys.executable, "-m", "deploy.cli", "eval", "--env", env, "--env-url", url, "--policy", "oracle",
                "--episodes", str(episodes), "--out", str(out)]
        for setting in settings:
            args += ["--set", setting]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        [result] = json.loads(out.read_text())
    return result
