"""The broadcast weight transport between real processes over gloo: the learner's sender
(this test process), actors' receivers in processes of their own (real vLLM engines, or a
stand-in that loads the staged file and checks every tensor), one group for all of them, a
late joiner, actors that leave, hang and come back, and a learner that never sends."""

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from actors.weights import BroadcastLink, WeightGate, apply_newest
from broker.connection import connect
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.weights import WeightStore, WeightVersionError
from common.config import LearnerConfig
from common.models import init_tiny_model, load_causal_lm
from common.weight_sync import open_store, pack
from learner.broadcast import BroadcastSender
from learner.trainer import Trainer
from tests.integration.weights_receiver import PROMPT

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


class Learner:
    """The learner's side as learner/worker.py runs it: pack, hand to the sender, announce."""

    def __init__(self, url: str, run: str, timeout_s: float):
        self.sender = BroadcastSender("127.0.0.1", 0, timeout_s)
        self.url, self.run = url, run

    bucket_bytes = 4 << 20

    def publish(self, version: int, state: dict) -> None:
        record = self.sender.publish(pack(version, state.items(), self.bucket_bytes, "cpu"), step=version)

        async def announce():
            client = connect(self.url)
            await WeightStore(client, Keys(self.run)).announce(record)
            await client.aclose()

        asyncio.run(announce())


def start_receiver(url, run, out, *args, timeout_s=5.0, env=None):
    return subprocess.Popen([sys.executable, "-m", "tests.integration.weights_receiver", url, run, str(out), *args],
                            env={**os.environ, "TIMEOUT_S": str(timeout_s), **(env or {})})


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


def sums(state: dict) -> dict:
    """Each tensor's sum: what a receiver reports of the version it loaded."""
    return {k: float(v.double().sum()) for k, v in state.items()}


def members(sender, count: int, timeout: float = 60.0) -> list[str]:
    """The sender's members' names once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while len(names := sender.member_names()) != count:
        assert time.monotonic() < deadline, names
        time.sleep(0.05)
    return names


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_versions_reach_real_vllm_engines_and_a_late_joiner_gets_the_current_one(redis_url, run_name, tmp_path):
    """A tied-embedding model (the output layer is the embedding: sent once, loaded by vLLM from
    it): version 1 reaches actor A; actor B starts later and gets version 1 (sent again, down a
    group of both); version 2 reaches both. Greedy continuations' log-probs match the learner's
    model for each version. A stopped actor leaves the group at once."""
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
        assert learner.sender.settled(30)  # the actors' word on version 2 is in
        assert sorted(learner.sender.member_names()) == sorted([f"receiver-{a.pid}", f"receiver-{b.pid}"])
        # v1 to A, v1 again to A and B (A relays it), v2 to both: 3 sends, 4 versions delivered.
        assert (learner.sender.sends, learner.sender.sent) == (3, 4)
        stop(a)
        assert members(learner.sender, 1, timeout=10) == [f"receiver-{b.pid}"]  # left: no timeout
    finally:
        stop(*[p for p in (a, b) if p is not None])
        learner.sender.close()


@pytest.mark.timeout(180)
def test_one_copy_leaves_the_learner_whatever_the_number_of_actors(redis_url, run_name, tmp_path):
    """Three actors in one group (they join on the first version's record): each later version
    leaves the learner once (to the head of the chain) and reaches all three whole; the
    learner's send volume is one version a version, in the group it built once."""
    state = {f"layer{i}.weight": torch.randn(256, 1024) for i in range(8)}  # 8 MB: several buckets
    learner = Learner(redis_url, run_name, timeout_s=20)
    learner.bucket_bytes = 3 << 20
    out = tmp_path / "reports.jsonl"
    procs = [start_receiver(redis_url, run_name, out, timeout_s=20) for _ in range(3)]
    try:
        learner.publish(1, state)
        for proc in procs:
            wait_for(out, 1, pid=proc.pid, timeout=60)
        sender = learner.sender
        assert sender.settled(30)
        sends, sent, nbytes, groups = sender.sends, sender.sent, sender.bytes_sent, sender.epochs
        for version in (2, 3):
            state = {k: v + version for k, v in state.items()}
            learner.publish(version, state)
            for proc in procs:
                assert wait_for(out, version, pid=proc.pid, timeout=60)["sums"] == pytest.approx(sums(state))
        assert sender.settled(30)
        size = sum(v.numel() * 4 for v in state.values())
        assert (sender.sends - sends, sender.sent - sent, sender.epochs) == (2, 6, groups)
        assert size <= (sender.bytes_sent - nbytes) / 2 < size + 64 * len(state)  # tensors 64-byte aligned
    finally:
        stop(*procs)
        learner.sender.close()


@pytest.mark.timeout(240)
def test_a_hung_actor_is_dropped_and_the_others_get_every_version(redis_url, run_name, tmp_path, caplog):
    """Actor H joins first (the head of the chain, between the learner and everyone else) and
    hangs (SIGSTOP) before version 2: the send stalls, H says nothing within the timeout (3 s)
    and is dropped, naming it; actor R, behind it, gets version 2 in a new group without H, and
    version 3. Woken, H finds itself dropped, joins again and gets the current version (3),
    never 2."""
    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(16)}
    learner = Learner(redis_url, run_name, timeout_s=3)
    out = tmp_path / "reports.jsonl"
    learner.publish(1, state)
    h = start_receiver(redis_url, run_name, out, timeout_s=3)
    r = None
    try:
        wait_for(out, 1, pid=h.pid, timeout=60)
        r = start_receiver(redis_url, run_name, out, timeout_s=3)
        wait_for(out, 1, pid=r.pid, timeout=60)
        assert learner.sender.member_names() == [f"receiver-{h.pid}", f"receiver-{r.pid}"]  # chain order
        with caplog.at_level(logging.INFO, logger="learner.broadcast"):
            h.send_signal(signal.SIGSTOP)
            state2 = {k: v + 1 for k, v in state.items()}
            learner.publish(2, state2)
            got = wait_for(out, 2, pid=r.pid, timeout=60)
            assert got["sums"] == pytest.approx(sums(state2))
            assert f"actor receiver-{h.pid} dropped from the weight group: no word" in caplog.text, caplog.text
            state3 = {k: v + 2 for k, v in state.items()}
            learner.publish(3, state3)
            got = wait_for(out, 3, pid=r.pid, timeout=30)  # not held back by the hung actor
            assert got["sums"] == pytest.approx(sums(state3))
            h.send_signal(signal.SIGCONT)
            got = wait_for(out, 3, pid=h.pid, timeout=60)
            assert got["sums"] == pytest.approx(sums(state3))
            assert not any(line["pid"] == h.pid and line["version"] == 2 for line in reports(out))
    finally:
        stop(*[p for p in (h, r) if p is not None])
        learner.sender.close()


@pytest.mark.timeout(240)
def test_an_actor_killed_in_the_middle_of_the_chain_costs_the_others_a_heartbeat_not_a_timeout(
        redis_url, run_name, tmp_path, caplog):
    """Three actors; the middle one of the chain is SIGKILLed and a version published at once
    (its heartbeat still fresh): the one after it fails to receive (its peer's socket is gone),
    the learner drops the dead one when its heartbeat stands still (10 s), far inside the
    60 s timeout, and the two alive get the version in a new group; so does the next one."""
    state = {f"layer{i}.weight": torch.randn(256, 1024) for i in range(8)}
    learner = Learner(redis_url, run_name, timeout_s=60)
    learner.bucket_bytes = 3 << 20
    out = tmp_path / "reports.jsonl"
    learner.publish(1, state)
    procs = []
    try:
        for _ in range(3):  # one at a time: the chain's order is the order they joined in
            procs.append(start_receiver(redis_url, run_name, out, timeout_s=60))
            wait_for(out, 1, pid=procs[-1].pid, timeout=60)
        first, middle, last = procs
        with caplog.at_level(logging.INFO, logger="learner.broadcast"):
            middle.kill()
            started = time.monotonic()
            state2 = {k: v + 1 for k, v in state.items()}
            learner.publish(2, state2)
            for proc in (first, last):
                assert wait_for(out, 2, pid=proc.pid, timeout=40)["sums"] == pytest.approx(sums(state2))
            took = time.monotonic() - started
            assert 5 < took < 40, took  # the heartbeat's 10 s, not the 60 s timeout
            assert f"actor receiver-{middle.pid} dropped from the weight group: no heartbeat" in caplog.text
            assert learner.sender.member_names() == [f"receiver-{first.pid}", f"receiver-{last.pid}"]
            state3 = {k: v + 2 for k, v in state.items()}
            learner.publish(3, state3)
            for proc in (first, last):
                assert wait_for(out, 3, pid=proc.pid, timeout=30)["sums"] == pytest.approx(sums(state3))
    finally:
        stop(*procs)
        learner.sender.close()


@pytest.mark.timeout(180)
def test_an_actor_that_cannot_stage_still_relays_and_a_join_never_written_holds_up_no_one(
        redis_url, run_name, tmp_path, caplog):
    """A number taken from the join counter whose entry never comes (its actor died between
    the two) is skipped, so actors joining after it are admitted. Actor U stages into a
    directory it cannot write to: it relays each version all the same (actor W, after it in
    the chain, gets every one whole, in the same group: no new group for a local failure),
    and after three such failures it is dropped."""
    state = {f"layer{i}.weight": torch.randn(256, 1024) for i in range(8)}
    learner = Learner(redis_url, run_name, timeout_s=20)
    learner.bucket_bytes = 3 << 20
    out = tmp_path / "reports.jsonl"
    learner.sender.store.add("joins", 1)  # a joiner that died before writing join/0
    unwritable = tmp_path / "a-file"  # a "directory" that is a file: nothing can be written under it, root or not
    unwritable.write_text("")
    learner.publish(1, state)
    u = w = None
    try:
        with caplog.at_level(logging.INFO, logger="learner.broadcast"):
            u = start_receiver(redis_url, run_name, out, timeout_s=20, env={"STAGING_DIR": str(unwritable)})
            assert members(learner.sender, 1, timeout=60) == [f"receiver-{u.pid}"]  # admitted past the hole
            assert "joins entry 0 never came" in caplog.text
            w = start_receiver(redis_url, run_name, out, timeout_s=20)
            assert wait_for(out, 1, pid=w.pid, timeout=60)["sums"] == pytest.approx(sums(state))
            assert learner.sender.member_names()[:1] == [f"receiver-{u.pid}"]  # U was at the head: W got it through U
            for version in (2, 3):
                state = {k: v + 1 for k, v in state.items()}
                learner.publish(version, state)
                assert wait_for(out, version, pid=w.pid, timeout=30)["sums"] == pytest.approx(sums(state))
            deadline = time.monotonic() + 30
            while f"actor receiver-{u.pid} dropped from the weight group: failed 3" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.1)
            # Versions 1 (again, for W) and 2 went to both in one group: U's failures built no new one.
            sends = re.findall(r"weight version (\d) sent to 1 of 2 actors in [\d.]+s \(group (\d+)\); failed at "
                               rf"\['receiver-{u.pid}'\]", caplog.text)
            assert [v for v, _ in sends][:2] == ["1", "2"] and len({g for _, g in sends[:2]}) == 1, caplog.text
            assert not any(line["pid"] == u.pid for line in reports(out))  # it never loaded one
    finally:
        stop(*[p for p in (u, w) if p is not None])
        learner.sender.close()


@pytest.mark.timeout(180)
def test_a_restarted_learner_s_version_is_loaded_not_one_the_old_learner_sent_before_it_died(
        redis_url, run_name, tmp_path):
    """The old learner's sender sends version 2 to the actor, then dies before announcing it;
    the new learner (another address and session) publishes its own version 2: the actor
    loads the new learner's weights, not the version 2 it staged from the old one."""
    state = {f"layer{i}.weight": torch.randn(256, 1024) for i in range(4)}
    old = Learner(redis_url, run_name, timeout_s=20)
    out = tmp_path / "reports.jsonl"
    old.publish(1, state)
    r = start_receiver(redis_url, run_name, out, timeout_s=20)
    new = None
    try:
        wait_for(out, 1, pid=r.pid, timeout=60)
        sent = old.sender.sent
        old.sender.publish(pack(2, {k: v * 2 for k, v in state.items()}.items(), old.bucket_bytes, "cpu"), step=2)
        deadline = time.monotonic() + 30
        while old.sender.sent == sent:  # sent and staged, never announced
            assert time.monotonic() < deadline
            time.sleep(0.05)
        old.sender.close()
        new = Learner(redis_url, run_name, timeout_s=20)
        state2 = {k: v - 1 for k, v in state.items()}
        new.publish(2, state2)
        assert wait_for(out, 2, pid=r.pid, timeout=60)["sums"] == pytest.approx(sums(state2))
    finally:
        stop(r)
        if new is not None:
            new.sender.close()


def test_a_learner_that_never_sends_fails_the_update_and_leaves_the_weights_alone(redis_url, run_name, tmp_path):
    """The actor joins the learner's group and the version never comes: the update fails after
    weights.timeout_s, saying so; the engine's weights were never touched (the gate stays open:
    generation goes on on the version it has)."""
    store = open_store("127.0.0.1", 0, 10, master=True)  # a learner's store, and no sender behind it

    async def scenario():
        client = connect(redis_url)
        weights = WeightStore(client, Keys(run_name))
        await weights.announce({"version": 1, "step": 1, "transport": "broadcast", "nbytes": 0, "sha256": "",
                                "address": f"127.0.0.1:{store.port}", "session": "s"})
        gate = WeightGate(0)
        link = BroadcastLink("actor-a", str(tmp_path), timeout_s=2)
        started = time.monotonic()
        with pytest.raises(WeightVersionError, match=r"did not arrive .* within weights.timeout_s \(2s\)"):
            await apply_newest(weights, gate, None, "/nonexistent", link=link)
        took = time.monotonic() - started
        joined = store.check(["join/0"])
        link.close()
        await client.aclose()
        return gate, took, joined

    gate, took, joined = asyncio.run(scenario())
    assert joined and 1.5 < took < 10 and not gate.broken and gate.version == 0
    deadline = time.monotonic() + 5
    while not store.check(["leave/0"]):  # closing the link left the group
        assert time.monotonic() < deadline
        time.sleep(0.05)
