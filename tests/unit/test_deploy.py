"""The deployment files that no unit test can run: the compose file as `docker compose
config` reads it (where compose is installed), and the Kubernetes manifests against the
API's schemas (kubernetes-validate) and against each other and the CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"
ROLES = {"init-model", "env-server", "actor", "learner"}


def manifests() -> list[dict]:
    return [doc for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def compose() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config_accepts_the_file(profile):
    cmd = compose()
    if cmd is None:
        pytest.skip("no docker compose here (bash deploy/docker/engine.sh installs it as root)")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "COMPOSE_PROFILES": profile, "OMRL_EXTRA": profile}
    if profile == "gpu":
        env.update(COMPOSE_PROFILES="gpu,gpu-eval")
    proc = subprocess.run([*cmd, "config"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    actor = services["actor" if profile == "cpu" else "actor-gpu"]
    assert actor["image"] == f"openmanus-rl:{profile}" and actor["restart"] == "unless-stopped"
    assert actor["shm_size"] and "container_name" not in actor and "ports" not in actor
    assert not any("--index" in part for part in actor["command"])  # replicas take their index from Redis
    if profile == "gpu":
        reservation = actor["deploy"]["resources"]["reservations"]["devices"][0]
        assert reservation["capabilities"] == ["gpu"] and actor["environment"]["OMRL_ACTOR__GPU_BY_INDEX"] == "true"
    evaluator = services["evaluator" if profile == "cpu" else "evaluator-gpu"]  # on by default
    assert evaluator["command"][-1] == "--evaluator" and evaluator["restart"] == "on-failure"
    assert evaluator["environment"]["OMRL_LEARNER__EVAL_EVERY"] == ""  # the config's, unless OMRL_EVAL_EVERY
    if profile == "gpu":  # it picks GPUs the learner and the actors leave, by the rule omrl run places it by
        assert evaluator["environment"]["OMRL_ACTOR__GPU_BY_INDEX"] == "true"
        assert evaluator["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
        assert services["evaluator"]["profiles"] == ["cpu"]  # the CPU one stays out of the GPU profile
    assert "--appendonly" in services["redis"]["command"]


def test_kubernetes_manifests_pass_the_api_schemas():
    docs = manifests()
    assert {d["kind"] for d in docs} >= {"ConfigMap", "StatefulSet", "Service", "Job", "Deployment", "NetworkPolicy",
                                          "PersistentVolumeClaim"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises with the field's path
    broken = {**docs[0], "metadata": {"name": "x", "lables": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does catch a misspelt field
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kubernetes_manifests_fit_together():
    """Services select pods that exist, every ConfigMap and claim named is defined, the
    containers run CLI roles, no actor is given an index (replicas take one from Redis), and
    every role's container is restarted by a liveness probe that reads the beat file it sets."""
    docs = manifests()
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs}
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs if "template" in d.get("spec", {})]
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pod_labels), svc["metadata"]
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in defined
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in defined
        for container in pod.get("initContainers", []) + pod["containers"]:
            if container["image"].startswith("openmanus-rl:"):
                assert container["args"][0] in ROLES, container["args"]
                assert "--index" not in container["args"]
                if container["args"][0] in ("actor", "learner", "env-server"):  # hung, it is restarted
                    beat_file = {e["name"]: e.get("value") for e in container["env"]}["OMRL_BEAT_FILE"]
                    probe = container["livenessProbe"]["exec"]["command"]
                    assert probe[:4] == ["python", "-m", "common.liveness", beat_file], probe
                mounts = {m["name"] for m in container.get("volumeMounts", [])}
                assert mounts <= {v["name"] for v in pod.get("volumes", [])}, container["name"]
        if d["metadata"]["labels"].get("app.kubernetes.io/component") in ("actor", "learner", "evaluator"):
            assert any(m["mountPath"] == "/dev/shm" for c in pod["containers"] for m in c.get("volumeMounts", []))

    (evaluator,) = [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "evaluator"]
    assert evaluator["kind"] == "Deployment"  # on by default, as in omrl run and compose
    assert evaluator["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "--evaluator"
