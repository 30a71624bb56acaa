"""Every example's run TOML loads and passes the checks a run makes before it starts.

For each examples/*/run.toml: `common.config.load_config` reads it (validation, cross-field
rules); then the preflight checks of `omrl run` (deploy/preflight.py: names, model, context
length, Redis, env server, ports, run directory, GPU) run on it, and, for an example whose
roles are started one by one (Redis and the env server at fixed addresses), the learner's and
the actor's checks too. Where the example names its own services, they are started here as
the example starts them (a Redis server, `omrl env-server`, the example's own server) and the
addresses pointed at them. A model the example names that cannot be downloaded here (no
network, no hub) is stood in for by a locally built model of the same architecture
(`common.models.init_tiny_model`: Qwen2, as Qwen2.5 is) with the real model's context length
written into its config, so the model and context checks see what they would see. The stand-in
is loaded with transformers, with its tokenizer.

Not checked here: anything that needs a GPU (the GPU check must fail on this machine, naming
the missing GPU, and only it), vLLM loading the real model, the real model's tokenizer and chat
template (the stand-in's are the tiny model's), memory, NCCL, and whether training learns: the
examples that run on a CPU are the runs the tests in tests/e2e make (letters, grid_nav, the
BabyAI demo); the GPU examples have never run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from broker.embedded import EmbeddedRedis, free_port
from common.config import load_config
from deploy.preflight import run_checks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("**/*.toml"))

# Models the examples name that cannot be downloaded here: the architecture (config.json's
# model_type) and context length (max_position_embeddings) of the real one.
REAL_MODELS = {
    "Qwen/Qwen2.5-1.5B-Instruct": ("qwen2", 32768),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2", 32768),
    "runs/demo-babyai/sft": ("qwen2", 4096),  # the demo's SFT model: a tiny Qwen2 built here
}
# What each example needs beyond the CPU, Redis and our env servers.
NEEDS = {"babyai-sft-rl": "minigrid", "chat-model-1gpu": "minigrid", "chat-model-8gpu": "minigrid",
         "compose-gpu": "minigrid"}


def _example(path: Path) -> str:
    return path.parent.name


def _params():
    for path in EXAMPLES:
        marks = [pytest.mark.redis] if load_config(path, environ=_compose_environ(_example(path))).redis.url else []
        if NEEDS.get(_example(path)) == "minigrid":
            marks.append(pytest.mark.babyai)
        yield pytest.param(path, id=_example(path), marks=marks)


def test_there_is_an_example_per_recipe():
    names = {_example(p) for p in EXAMPLES}
    assert {"letters-cpu", "grid-nav", "babyai-sft-rl", "chat-model-1gpu", "chat-model-8gpu", "own-server",
            "compose-gpu"} <= names
    for name in names:
        readme = ROOT / "examples" / name / "README.md"
        assert readme.is_file(), f"examples/{name} has no README.md"
        assert len(readme.read_text().splitlines()) <= 30, f"examples/{name}/README.md is over 30 lines"


@pytest.fixture(scope="module")
def stand_ins(tiny_model, tmp_path_factory) -> dict[str, str]:
    """A local model per real model named: the tiny Qwen2 with the real one's context length."""
    out = {}
    for name, (model_type, positions) in REAL_MODELS.items():
        target = tmp_path_factory.mktemp("stand-in")
        shutil.copytree(tiny_model, target, dirs_exist_ok=True)
        config = json.loads((target / "config.json").read_text())
        assert config["model_type"] == model_type
        config["max_position_embeddings"] = positions
        (target / "config.json").write_text(json.dumps(config))
        out[name] = str(target)
    return out


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout:.0f}s")


def _start(stack: ExitStack, argv: list[str], port: int) -> str:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(30)))
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/", proc)
    return url


def _compose_environ(name: str) -> dict[str, str]:
    """The variables docker-compose.yml gives the example's services (compose examples only)."""
    if not name.startswith("compose"):
        return {}
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return {k: str(v) for k, v in services["actor-gpu"]["environment"].items()}


@pytest.mark.parametrize("path", list(_params()))
def test_example_loads_and_passes_the_checks_a_run_makes(path, stand_ins, tmp_path):
    name = _example(path)
    if NEEDS.get(name):
        pytest.importorskip(NEEDS[name], reason=f"examples/{name} plays an env whose extra is not installed")
    environ = _compose_environ(name)
    cfg = load_config(path, environ=environ)
    overrides = [f"run.run_dir={json.dumps(str(tmp_path / 'run'))}"]
    if environ.get("OMRL_MODEL__PATH"):  # compose: the model comes from OMRL_MODEL_PATH (a hub id, say)
        overrides.append(f"model.path={json.dumps(stand_ins['Qwen/Qwen2.5-1.5B-Instruct'])}")
    elif cfg.model.path:
        assert cfg.model.path in REAL_MODELS, f"add {cfg.model.path} to REAL_MODELS"
        overrides.append(f"model.path={json.dumps(stand_ins[cfg.model.path])}")
    roles = ["run"]
    with ExitStack() as stack:
        if cfg.redis.url:  # roles started one by one: the example's Redis, here
            overrides.append(f"redis.url={json.dumps(stack.enter_context(EmbeddedRedis()).url)}")
            roles += ["learner", "actor"]
        if cfg.env.url:
            port = free_port()
            server = ROOT / "examples" / name / "server.py"
            argv = ([sys.executable, str(server), "--port", str(port)] if server.is_file() else
                    [sys.executable, "-m", "envs", "--env", cfg.env.name, "--port", str(port)])
            overrides.append(f"env.url={json.dumps(_start(stack, argv, port))}")
        cfg = load_config(path, overrides, environ=environ)
        results = {(role, r.check): r for role in roles for r in run_checks(cfg, role)}
    import torch

    for (role, check), r in results.items():
        if check == "gpu" and cfg.learner.device == "cuda" and not torch.cuda.is_available():
            assert r.status == "fail" and "sees no GPU" in r.detail, r
        else:
            assert r.status == "ok", f"{name}, {role} check {check}: {r.status}: {r.line()}"
    if cfg.model.path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoTokenizer.from_pretrained(cfg.model.path)
        assert AutoModelForCausalLM.from_pretrained(cfg.model.path).config.max_position_embeddings >= \
            cfg.actor.max_seq_len


def test_own_server_plays_an_episode_through_our_client():
    """examples/own-server/server.py against envs.client.EnvClient: the AgentGym "id" protocol."""
    import asyncio

    import aiohttp

    from envs.client import EnvClient, EnvError
    from envs.specs import spec_for

    async def play(url: str) -> list:
        async with aiohttp.ClientSession() as session:
            client = EnvClient(url, session, 10.0, spec_for("guess_digit"))
            assert "ok" in await client.health()
            env_id = await client.create()
            first = await client.reset(env_id, 1007)  # the secret is 1007 % 10 = 7
            steps = [first] + [await client.step(env_id, guess) for guess in ("5", "9", "x", "7")]
            assert await client.observation(env_id) == "right"
            assert await client.close(env_id)
            with pytest.raises(EnvError, match="404"):
                await client.step(env_id, "7")
            return steps

    with ExitStack() as stack:
        port = free_port()
        url = _start(stack, [sys.executable, str(ROOT / "examples/own-server/server.py"), "--port", str(port)], port)
        steps = asyncio.run(play(url))
    assert [s.observation for s in steps] == ["guess a digit", "higher", "lower", "say one digit", "right"]
    assert [s.reward for s in steps] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert [s.done for s in steps] == [False, False, False, False, True]
    assert spec_for("guess_digit").succeeded(True, 1.0, steps[-1].info)
