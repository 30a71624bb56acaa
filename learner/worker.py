"""The learner process shell: signals, broker reads (through the bridge thread), weight
publication, checkpoints, acknowledgements and metrics around the pure training step.

Exactly-once training on at-least-once delivery: the newest group ids trained on are
recorded in the checkpoint, groups are acknowledged only after the checkpoint that holds
them, and a group whose id was already trained on is acknowledged and skipped.

On SIGTERM or SIGINT the learner finishes the step it is in, commits what it trained on
(checkpoint, then acknowledgements) and exits with 128 + the signal's number; it exits 0
only when it reached `learner.steps`, so a supervisor can tell "done" from "stopped".
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from broker.admission import floor_accepted
from broker.weights import WeightStore, WeightsTooLarge
from common.config import Config
from common.messages import RolloutGroup
from common.metrics import JsonlSink
from common.models import load_causal_lm
from learner.batch import collate
from learner.bridge import BrokerBridge, Delivery
from learner.checkpoint import LearnerState, RecentIds, load_latest, save_checkpoint
from learner.trainer import Trainer

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, cfg: Config):
        if not cfg.model.path:
            raise SystemExit("error: model.path is unset: pass --set model.path=DIR (see `omrl init-model`)")
        if not cfg.redis.url:
            raise SystemExit("error: redis.url is unset: pass --set redis.url=redis://HOST:PORT/0")
        self.cfg = cfg
        self.stopped_by: int | None = None  # the signal that asked the learner to stop
        self.state = LearnerState()
        self.seen = RecentIds(cfg.learner.dedup_window)  # every group trained on, committed or not
        self.uncommitted: list[Delivery] = []  # trained on, not yet in a checkpoint
        self.counts = {"duplicates": 0, "stale": 0}
        self.checkpoint_dir = Path(cfg.run.run_dir) / "checkpoints"

    def _on_signal(self, signum, frame) -> None:
        log.info("signal %d: stopping after this step, committing what was trained on", signum)
        self.stopped_by = signum

    @property
    def stopping(self) -> bool:
        return self.stopped_by is not None

    def _next_groups(self, bridge: BrokerBridge) -> list[Delivery]:
        """B usable groups; duplicates are acknowledged and stale ones dead-lettered."""
        lcfg = self.cfg.learner
        batch: list[Delivery] = []
        while len(batch) < lcfg.groups_per_step and not self.stopping:
            d = bridge.get(timeout=0.5)
            if d is None:
                continue
            gid = d.group.group_id
            # `seen` holds every group trained on, committed or not; `batch` the ones just taken.
            if gid in self.seen or any(gid == b.group.group_id for b in batch):
                self.counts["duplicates"] += 1
                log.info("group %s delivered again (entry %s): already trained on, acknowledged", gid, d.entry_id)
                bridge.ack([d])
                continue
            staleness = self.state.version - d.group.oldest_version()
            log.debug("group %s from %s: staleness %d", gid, d.group.actor_id, staleness)
            if staleness > lcfg.max_staleness:
                self.counts["stale"] += 1
                bridge.dead_letter(d, "stale", f"staleness {staleness} > learner.max_staleness {lcfg.max_staleness}")
                continue
            batch.append(d)
        return batch

    def _publish(self, bridge: BrokerBridge, trainer: Trainer) -> None:
        store: WeightStore = bridge.store
        blob = trainer.weights_blob()
        version, step = self.state.version, self.state.step
        keys = bridge.keys

        trained = self.state.groups_trained

        async def publish():
            await store.publish(version, step, blob)
            await bridge.client.hset(keys.learner_state, mapping={"step": step, "version": version,
                                                                  "groups_trained": trained, "time": time.time()})
            await floor_accepted(bridge.client, keys, trained)

        try:
            bridge.call(publish, "publish weights")
        except WeightsTooLarge as exc:
            raise SystemExit(f"error: {exc}") from None

    def _commit(self, bridge: BrokerBridge, trainer: Trainer) -> None:
        """Checkpoint, then acknowledge every group the checkpoint holds."""
        self.state.trained_ids = self.seen.to_list()
        save_checkpoint(self.checkpoint_dir, self.state, trainer.model, trainer.optimizer, self.cfg.learner.keep_checkpoints)
        bridge.ack(self.uncommitted)
        self.uncommitted = []
        committed, keys = self.state.groups_trained, bridge.keys
        # For the run's accounting: trained and acknowledged (no longer in a stream).
        bridge.call(lambda: bridge.client.hset(keys.learner_state, "groups_committed", committed), "learner state")

    def run(self) -> int:
        """Train to learner.steps (exit code 0) or until a signal (128 + its number)."""
        cfg, lcfg = self.cfg, self.cfg.learner
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        torch.manual_seed(lcfg.seed)
        torch.set_num_threads(lcfg.threads)
        trainer = Trainer(load_causal_lm(cfg.model.path, cfg.model.dtype), lcfg)
        restored = load_latest(self.checkpoint_dir, trainer.model, trainer.optimizer)
        bridge = BrokerBridge(cfg.redis, consumer=lcfg.consumer, keep_versions=lcfg.keep_versions,
                              queue_size=2 * lcfg.groups_per_step, read_count=lcfg.groups_per_step).start()
        latest = bridge.call(bridge.store.latest, "read the weight version")
        if restored is not None:
            self.state = restored
            self.seen.add(restored.trained_ids)
        if latest is None or restored is None or latest["version"] != self.state.version:
            # First start, or weights newer than the checkpoint were published before a crash:
            # publish what this learner holds under a fresh version number.
            self.state.version = max(self.state.version, latest["version"] + 1 if latest else 0)
            self._publish(bridge, trainer)
        if self.state.step >= lcfg.steps:
            log.warning("the checkpoint in %s is at step %d, learner.steps is %d: nothing to do (use a new run dir "
                        "or raise --steps to continue)", self.checkpoint_dir, self.state.step, lcfg.steps)
        sink = JsonlSink(Path(cfg.run.run_dir) / "metrics.jsonl")
        log.info("learner ready: step %d, version %d, %d steps of %d groups", self.state.step, self.state.version,
                 lcfg.steps, lcfg.groups_per_step)
        step_times: deque[float] = deque([time.monotonic()], maxlen=2)
        try:
            while self.state.step < lcfg.steps:
                waited = time.monotonic()
                batch = self._next_groups(bridge)
                waited = time.monotonic() - waited
                if self.stopping:
                    break
                self.state.groups_trained += len(batch)
                record = self._step(trainer, bridge, [d.group for d in batch])
                self.uncommitted += batch
                self.seen.add(d.group.group_id for d in batch)
                step_times.append(time.monotonic())
                dt = step_times[1] - step_times[0]
                record.update(self._evals(bridge))
                record.update({"time": time.time(), "perf/step_s": dt, "perf/wait_s": waited,
                               "perf/groups_per_s": len(batch) / dt,
                               "perf/tokens_per_s": record["batch/generated_tokens"] / dt,
                               "batch/group_ids": [d.group.group_id for d in batch]})
                # The record before the checkpoint: a crash between them trains the step again and
                # writes its record twice (the last one counts), never a checkpointed step without one.
                sink.write(record)
                if self.state.step % lcfg.checkpoint_every == 0 or self.state.step == lcfg.steps:
                    self._commit(bridge, trainer)
                log.info("step %d reward %.3f groups/s %.2f tokens/s %.0f version %d staleness %.2f",
                         self.state.step, record["reward/mean"], record["perf/groups_per_s"],
                         record["perf/tokens_per_s"], self.state.version, record["staleness/mean"])
            if self.uncommitted:  # stopped between checkpoints: clean stops lose nothing
                self._commit(bridge, trainer)
        finally:
            sink.close()
            bridge.stop()
        if self.stopping and self.state.step < lcfg.steps:
            log.info("stopped by signal %d at step %d, version %d (committed)", self.stopped_by, self.state.step,
                     self.state.version)
            return 128 + self.stopped_by
        final = self._save_final(trainer)
        log.info("learner done at step %d, version %d; the trained model is in %s (omrl eval --model %s)",
                 self.state.step, self.state.version, final, final)
        return 0

    def _save_final(self, trainer: Trainer) -> Path:
        """The trained weights with the tokenizer, as a Hugging Face model directory."""
        from transformers import AutoTokenizer

        final = Path(self.cfg.run.run_dir) / "final"
        trainer.model.save_pretrained(final, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.cfg.model.path).save_pretrained(final)
        return final

    @staticmethod
    def _evals(bridge: BrokerBridge) -> dict:
        """The newest evaluation that arrived since the last step, as eval/* metrics."""
        newest = None
        while bridge.evals:  # the bridge thread appends; pop is atomic
            newest = bridge.evals.pop(0)
        return {f"eval/{k}": v for k, v in newest.items()} if newest else {}

    def _step(self, trainer: Trainer, bridge: BrokerBridge, groups: list[RolloutGroup]) -> dict:
        lcfg = self.cfg.learner
        batch = collate(groups, scale_by_std=lcfg.algorithm == "grpo")
        staleness = np.array([self.state.version - g.oldest_version() for g in groups])
        metrics = trainer.train_step(batch)
        self.state.step += 1
        if self.state.step % lcfg.publish_every == 0:
            self.state.version += 1
            t0 = time.perf_counter()
            self._publish(bridge, trainer)
            metrics["learner/time/publish_s"] = time.perf_counter() - t0
        generated = np.concatenate([s.versions[s.loss_mask.astype(bool)] for g in groups for s in g.samples])
        samples = [s for g in groups for s in g.samples]
        turns = sum(s.num_turns for s in samples)
        return {
            "step": self.state.step,
            "weight_version": self.state.version,
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()),
            "reward/env": float(np.mean([s.turn_rewards.sum() for s in samples])),
            "reward/success": float(np.mean([s.success for s in samples])),
            "actor/invalid_action_frac": sum(s.invalid_actions for s in samples) / max(1, turns),
            "batch/turns_mean": turns / len(samples),
            "batch/groups": len(groups),
            "batch/zero_signal_frac": float((~batch.group_signal).mean()),
            "batch/generated_tokens": int(generated.size),
            "batch/version_min": int(generated.min()) if generated.size else -1,
            "batch/version_max": int(generated.max()) if generated.size else -1,
            "staleness/mean": float(staleness.mean()),
            "staleness/max": int(staleness.max()),
            "staleness/hist": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))},
            "learner/groups_trained": self.state.groups_trained,
            "broker/duplicates": self.counts["duplicates"],
            "broker/stale": self.counts["stale"],
            "broker/dead_letters": dict(bridge.dead_letters),
            **metrics,
        }


def main(cfg: Config) -> int:
    os.makedirs(cfg.run.run_dir, exist_ok=True)
    return Learner(cfg).run()
