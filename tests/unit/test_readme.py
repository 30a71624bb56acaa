"""The README opens with the two commands that CI and new users run; keep them honest."""

import tomllib
from pathlib import Path

import yaml

from common.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def opening_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_run_and_test_commands():
    run_cmd, test_cmd = opening_commands()[:2]
    assert "omrl run" in run_cmd and "deploy/setup.sh" in run_cmd
    assert "pytest" in test_cmd and "deploy/setup.sh" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()


def test_compose_services_match_the_config_and_commands():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "env", "learner", "actor", "init-model"} <= set(services)
    actor = services["actor"]
    # --scale actor=N needs no fixed name and no fixed host port.
    assert "container_name" not in actor and "ports" not in actor
    dockerfile = ROOT / actor["build"]["context"] / actor["build"]["dockerfile"]
    assert dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    assert services["init-model"]["command"][0] == "init-model"
    for name, role in (("env", "env-server"), ("learner", "learner"), ("actor", "actor"), ("evaluator", "actor")):
        assert services[name]["command"][:2] == ["watch", role]  # a hung role: the container exits for its restart
    # Every variable the services get, and the mounted config, must load as a valid config.
    tomllib.loads((ROOT / "deploy" / "compose.toml").read_text())
    env = {k: str(v) for k, v in actor["environment"].items()}
    cfg = load_config(ROOT / "deploy" / "compose.toml", environ=env)
    assert cfg.redis.url == "redis://redis:6379/0" and cfg.env.base_url == "http://env:36001"
    # Processes that die come back (the learner only when it did not finish: exit code 0 is done).
    assert services["learner"]["restart"] == "on-failure"
    assert all(services[name]["restart"] == "unless-stopped" for name in ("redis", "env", "actor"))
    for dep, cond in actor["depends_on"].items():
        assert dep in services and cond["condition"].startswith("service_")
