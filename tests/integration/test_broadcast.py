"""The broadcast weight transport between real processes over gloo: the learner's sender
(this test process), actors' receivers in processes of their own (real vLLM engines, or a
stand-in for vLLM's worker that checks every tensor), a late joiner, and peers that hang."""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from actors.weights import BroadcastLink, WeightGate, apply_newest
from broker.connection import connect
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.weights import WeightStore
from common.config import LearnerConfig
from common.models import init_tiny_model, load_causal_lm
from common.weight_sync import open_group, open_store, pack
from learner.broadcast import BroadcastSender
from learner.trainer import Trainer
from tests.integration.weights_receiver import PROMPT, TensorEngine

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


class Learner:
    """The learner's side as learner/worker.py runs it: pack, hand to the sender, announce."""

    def __init__(self, url: str, run: str, timeout_s: float):
        self.sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s)
        self.url, self.run = url, run

    def publish(self, version: int, state: dict) -> None:
        record = self.sender.publish(pack(version, state.items(), 4 << 20, "cpu"), step=version)

        async def announce():
            client = connect(self.url)
            await WeightStore(client, Keys(self.run)).announce(record)
            await client.aclose()

        asyncio.run(announce())


def start_receiver(url, run, out, *args, timeout_s=5.0):
    return subprocess.Popen([sys.executable, "-m", "tests.integration.weights_receiver", url, run, str(out), *args],
                            env={**os.environ, "TIMEOUT_S": str(timeout_s)})


def reports(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(path, version: int, pid: int | None = None, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in reports(path):
            if line["version"] == version and (pid is None or line["pid"] == pid):
                return line
        time.sleep(0.1)
    raise AssertionError(f"version {version} not reported in {path}: {reports(path)}")


def stop(*procs):
    for proc in procs:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=60)


def perturbed_state(model, seed: int) -> dict:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return Trainer(model, LearnerConfig()).hf_state()


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return np.array([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)])


@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_versions_reach_real_vllm_engines_and_a_late_joiner_gets_the_current_one(redis_url, run_name, tmp_path):
    """A tied-embedding model (the output layer is the embedding: sent once, loaded by vLLM from
    it): version 1 reaches actor A; actor B starts later and gets version 1 on joining; version
    2 reaches both. Greedy continuations' log-probs match the learner's model for each version."""
    path = str(init_tiny_model(tmp_path / "tied", tie_embeddings=True))
    model = load_causal_lm(path)
    learner = Learner(redis_url, run_name, timeout_s=60)
    tok = None
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = perturbed_state(model, seed=1)
    assert "lm_head.weight" not in first
    learner.publish(1, first)
    a = start_receiver(redis_url, run_name, out_a, "--model", path, timeout_s=60)
    b = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        got = wait_for(out_a, 1, timeout=240)
        np.testing.assert_allclose(got["logprobs"], hf_logprobs(model, prompt, got["tokens"]), atol=2e-3)
        b = start_receiver(redis_url, run_name, out_b, "--model", path, timeout_s=60)
        late = wait_for(out_b, 1, timeout=240)
        assert late["tokens"] == got["tokens"]
        perturbed_state(model, seed=2)
        learner.publish(2, Trainer(model, LearnerConfig()).hf_state())
        for out in (out_a, out_b):
            got = wait_for(out, 2)
            np.testing.assert_allclose(got["logprobs"], hf_logprobs(model, prompt, got["tokens"]), atol=2e-3)
        assert sorted(learner.sender.links.values()) == sorted([f"receiver-{a.pid}", f"receiver-{b.pid}"])
        assert learner.sender.sent == 4
    finally:
        stop(*[p for p in (a, b) if p is not None])
        learner.sender.close()


@pytest.mark.timeout(180)
def test_a_hung_actor_times_out_its_own_link_and_the_others_go_on(redis_url, run_name, tmp_path, caplog):
    """Actor H asks for version 1 and hangs (SIGSTOP) with 64 MB to receive: the learner's send
    to it times out (3 s) naming it, while actor R gets versions 1 and 2 whole. Woken, H finds
    its group gone, joins again and gets the current version (2)."""
    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(16)}
    sums = lambda s: {k: float(v.double().sum()) for k, v in s.items()}  # noqa: E731
    learner = Learner(redis_url, run_name, timeout_s=3)
    out = tmp_path / "reports.jsonl"
    r = start_receiver(redis_url, run_name, out, timeout_s=3)
    h = start_receiver(redis_url, run_name, out, "--hang", timeout_s=3)
    try:
        with caplog.at_level(logging.INFO, logger="learner.broadcast"):
            learner.publish(1, state)
            got = wait_for(out, 1, pid=r.pid, timeout=60)
            assert got["sums"] == pytest.approx(sums(state))
            deadline = time.monotonic() + 30
            while f"weight link to actor receiver-{h.pid} closed" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.1)
            assert "Timed out" in caplog.text
            state2 = {k: v + 1 for k, v in state.items()}
            learner.publish(2, state2)
            got = wait_for(out, 2, pid=r.pid, timeout=30)  # not held back by the hung actor
            assert got["sums"] == pytest.approx(sums(state2))
            h.send_signal(signal.SIGCONT)
            got = wait_for(out, 2, pid=h.pid, timeout=60)
            assert got["sums"] == pytest.approx(sums(state2))
            assert not any(line["pid"] == h.pid and line["version"] == 1 for line in reports(out))
    finally:
        stop(r, h)
        learner.sender.close()


def test_a_hung_learner_fails_the_actors_receive_with_a_clear_error(redis_url, run_name):
    """The learner joins the actor's group, is asked for a version and never sends: the actor's
    receive fails after its timeout, saying so, and its gate stays closed (nothing generates on
    weights that may be part-loaded) until a version loads whole."""
    store = open_store("127.0.0.1", 0, 10, master=True)

    def learner_that_hangs():
        while not store.check(["join/0"]):
            time.sleep(0.01)
        learner_that_hangs.group = open_group(store, "link/0", 0, 2, "gloo", 10)  # joined; sends nothing

    threading.Thread(target=learner_that_hangs, daemon=True).start()

    async def scenario():
        client = connect(redis_url)
        weights = WeightStore(client, Keys(run_name))
        await weights.announce({"version": 1, "step": 1, "transport": "broadcast", "nbytes": 0, "sha256": "",
                                "address": f"127.0.0.1:{store.port}", "backend": "gloo"})
        gate = WeightGate(0)
        link = BroadcastLink(TensorEngine(), "actor-a", timeout_s=2)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out waiting 2000ms"):
            await apply_newest(weights, gate, None, "/nonexistent", link=link)
        await client.aclose()
        return gate, link, time.monotonic() - started

    gate, link, took = asyncio.run(scenario())
    assert 1.5 < took < 10 and gate.broken and gate.version == 0 and link.address is None
