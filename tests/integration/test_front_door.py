"""The mistakes people make on day one, each through the CLI as a subprocess: exit code 2,
one line that names the cause and the fix, no traceback, nothing left running. And
`omrl doctor`: every check passes on the embedded defaults, and names what is wrong
against real servers (a Redis with a password, an env server spoken to in the wrong
protocol family)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.common import wait_http
from broker.embedded import EmbeddedRedis, free_port
from tests.procs import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]


def omrl(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """Run `omrl ARGS` in tmp_path (so the default run dir is there); its exit code and
    everything it printed."""
    environ = {**os.environ, "HF_HOME": str(tmp_path / "hf"), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def assert_one_line_error(code: int, out: str, tmp_path: Path, *names: str) -> None:
    assert code == 2, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert out.startswith("error: ") and all(n in out for n in names), out
    assert not processes_mentioning(str(tmp_path)), "a process was left behind"


@pytest.fixture(scope="module")
def env_url():
    """A real `letters` env server."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "envs", "--env", "letters", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(port, server, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


MISTAKES = {
    "model path that does not exist": (["run", "--model", "/nonexistent"], {},
                                       ["model.path = /nonexistent: no such directory", "save_pretrained"]),
    # No network: the hub's endpoint is a closed local port, and the cache is empty.
    "hub id with no network": (["run", "--model", "Qwen/Qwen2.5-0.5B"],
                               {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"},
                               ["hub cannot be reached", "--local-dir DIR", "pass --model DIR"]),
    "Redis that is not there": (["run", "--set", 'redis.url="redis://127.0.0.1:1/0"'], {},
                                ["cannot connect to redis://127.0.0.1:1/0", "start Redis there"]),
    "env server that is not there": (["run", "--set", 'env.url="http://127.0.0.1:9/"'], {},
                                     ["cannot reach the env server at http://127.0.0.1:9/", "omrl env-server"]),
    "unknown env": (["run", "--set", 'env.name="nope"'], {}, ["env.name = 'nope' is not a built-in env", "letters"]),
    "an option the env does not take": (["run", "--set", "env.options.turn=3"], {},
                                        ["env.options = {'turn': 3}: LettersEnv.__init__() got an unexpected keyword "
                                         "argument 'turn'", "only the options its class takes"]),
    "an env option's bad value": (["run", "--set", 'env.name="textcraft"', "--set", "env.options.shuffle_names=2"], {},
                                  ["env.options.shuffle_names is the share of tasks", "from 0 to 1, got 2"]),
    "context longer than the model's": (["run", "--set", "actor.max_seq_len=8192"], {},
                                        ["actor.max_seq_len = 8192", "4096 positions", "at most 4096"]),
    "run dir under a file": (["run", "--run-dir", "a-file/run"], {}, ["is not writable", "--run-dir DIR"]),
    "bad config value": (["run", "--set", "learner.lr=-1"], {}, ["learner.lr: Input should be greater than 0"]),
    "refused turns the env cannot name": (["run", "--set", 'learner.refused_turns="drop"'], {},
                                          ["learner.refused_turns = 'drop', but env 'letters'", "env.spec.refused"]),
    "a refused-turn reward the env cannot name": (["run", "--set", 'learner.algorithm="gigpo"', "--set",
                                                   "learner.refused_reward=-0.1"], {},
                                                  ["learner.refused_reward = -0.1, but env 'letters'",
                                                   "learner.refused_reward = 0"]),
    "a supervised term without episodes": (["run", "--set", "learner.sft_coef=0.1"], {},
                                            ["learner.sft_coef = 0.1 needs episodes", "set learner.sft_data"]),
    "a supervised term's file that is not there": (["run", "--set", "learner.sft_coef=0.1", "--set",
                                                    'learner.sft_data=["nope.parquet"]'], {},
                                                   ["learner.sft_data: nope.parquet does not exist", "omrl collect"]),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_is_one_line_with_the_fix_before_anything_starts(mistake, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    args, env, names = MISTAKES[mistake]
    start = time.monotonic()
    code, out = omrl(tmp_path, *args, env=env)
    assert_one_line_error(code, out, tmp_path, *names)
    assert time.monotonic() - start < 60, "the check should answer at once"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.log")), "something started"


@pytest.mark.redis
def test_a_role_started_by_hand_checks_too(tmp_path, redis_server_url, env_url):
    code, out = omrl(tmp_path, "actor", "--set", f'redis.url="{redis_server_url}"', "--set", f'env.url="{env_url}"')
    assert_one_line_error(code, out, tmp_path, "model.path is unset", "--set model.path=DIR")
    code, out = omrl(tmp_path, "learner", "--set", f'redis.url="{redis_server_url}"', "--set",
                     'model.path="/nonexistent"')
    assert_one_line_error(code, out, tmp_path, "model.path = /nonexistent: no such directory")


def test_env_server_on_a_port_in_use(tmp_path, busy_port):
    code, out = omrl(tmp_path, "env-server", "--port", str(busy_port))
    assert_one_line_error(code, out, tmp_path, f"env.port = {busy_port} on 127.0.0.1 is in use", "choose a free port")


def test_gpu_asked_for_where_there_is_none(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out = omrl(tmp_path, "run", "--set", 'learner.device="cuda"')
    assert_one_line_error(code, out, tmp_path, "learner.device = 'cuda'", "sees no GPU", "learner.device = 'auto'")


def test_debug_adds_the_traceback(tmp_path):
    code, out = omrl(tmp_path, "doctor", "--debug", "--set", 'redis.url="redis://127.0.0.1:1/0"')
    assert code == 2 and re.search(r"^redis +FAIL", out, re.M) and "Traceback" in out and "ConnectionRefusedError" in out
    code, out = omrl(tmp_path, "run", "--debug", "--set", 'redis.url="redis://127.0.0.1:1/0"')
    assert code == 2 and "Traceback" in out and out.splitlines()[-1].startswith("error: redis: cannot connect")


def test_doctor_passes_on_the_embedded_defaults(tmp_path):
    code, out = omrl(tmp_path, "doctor")
    assert code == 0, out
    assert out.splitlines()[-1] == "11 of 11 checks passed", out
    code, out = omrl(tmp_path, "doctor", "--json")
    results = json.loads(out)
    assert code == 0 and {r["check"] for r in results} >= {"model", "redis", "env", "ports", "run_dir", "gpu"}
    assert all(r["status"] == "ok" for r in results), results
    assert not (tmp_path / "runs").exists()  # doctor looks, it does not create


@pytest.mark.redis
def test_doctor_against_real_servers(tmp_path, env_url):
    """A Redis with a password (wrong, then right), and a real env server spoken to in its
    own protocol family (a create/reset/close probe passes) and in the other one (fails)."""
    with EmbeddedRedis(extra_args=["--requirepass", "s3cret"]) as redis:
        env = f'env.url="{env_url}"'
        wrong = f'redis.url="redis://:nope@127.0.0.1:{redis.port}/0"'
        code, out = omrl(tmp_path, "doctor", "--json", "--set", wrong, "--set", env)
        results = {r["check"]: r for r in json.loads(out)}
        assert code == 2 and results["redis"]["status"] == "fail", results["redis"]
        assert "refused the credentials" in results["redis"]["detail"] and "redis.url" in results["redis"]["fix"]
        assert "s3cret" not in out and "nope@" not in out  # no password is printed
        assert results["env"]["status"] == "ok" and "create/reset/close" in results["env"]["detail"]
        right = f'redis.url="redis://:s3cret@127.0.0.1:{redis.port}/0"'
        code, out = omrl(tmp_path, "doctor", "--json", "--set", right, "--set", env, "--set", 'env.protocol="env_idx"')
        results = {r["check"]: r for r in json.loads(out)}
        assert results["redis"]["status"] == "ok" and "Redis " in results["redis"]["detail"]
        assert code == 2 and results["env"]["status"] == "fail", results["env"]
        assert "protocol env_idx" in results["env"]["detail"] and "env.protocol" in results["env"]["fix"]


def test_a_run_that_cannot_go_on_ends_with_the_process_why_and_its_log(tmp_path):
    """Weights that no loader can read pass the checks (config and tokenizer are there);
    the processes that load them fail, and the run's last line names which, why, and where
    its log is: no later step (accounting, plots) speaks after it."""
    from common.models import init_tiny_model

    model = init_tiny_model(tmp_path / "model")
    (model / "model.safetensors").write_bytes(os.urandom(1000))
    code, out = omrl(tmp_path, "run", "--model", str(model), "--run-dir", str(tmp_path / "run"),
                     "--set", "supervisor.max_restarts=0", "--set", "supervisor.log_lines=0", timeout=300)
    last = out.splitlines()[-1]
    assert code == 1, out[-3000:]
    match = re.search(r"the run stopped: (\w+) exited with code 1, and (.*); its log: (\S+)$", last)
    assert match, last
    assert match[1] in ("learner", "actor0", "actor1")
    assert "restart budget" in match[2] or "after its first start" in match[2], match[2]
    assert Path(match[3]) == tmp_path / "run" / "logs" / f"{match[1]}.log" and Path(match[3]).exists()
    assert not processes_mentioning(str(tmp_path)), "a process was left behind"
