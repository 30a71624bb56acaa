"""The learner process shell: signals, broker reads (through the bridge thread), weight
publication, acknowledgements and metrics around the pure training step."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import torch

from broker.keys import Keys
from common.config import Config
from common.messages import RolloutGroup
from common.metrics import JsonlSink
from common.models import load_causal_lm
from learner.batch import collate
from learner.bridge import BrokerBridge
from learner.trainer import Trainer

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, cfg: Config):
        if not cfg.model.path:
            raise SystemExit("error: model.path is unset: pass --set model.path=DIR (see `omrl init-model`)")
        if not cfg.redis.url:
            raise SystemExit("error: redis.url is unset: pass --set redis.url=redis://HOST:PORT/0")
        self.cfg = cfg
        self.stopping = False
        self.version = 0
        self.seen: set[str] = set()
        self.counts = {"duplicates": 0, "stale": 0, "zero_signal": 0}

    def _on_signal(self, signum, frame) -> None:
        log.info("signal %d: stopping after this step", signum)
        self.stopping = True

    def _next_groups(self, bridge: BrokerBridge) -> tuple[list[str], list[RolloutGroup]]:
        """B usable groups; duplicates are acknowledged and stale ones dead-lettered."""
        lcfg = self.cfg.learner
        ids, groups = [], []
        while len(groups) < lcfg.groups_per_step and not self.stopping:
            item = bridge.get(timeout=0.5)
            if item is None:
                continue
            entry_id, data, group = item
            if group.group_id in self.seen or any(g.group_id == group.group_id for g in groups):
                self.counts["duplicates"] += 1
                bridge.call(bridge.consumer.ack([entry_id]))
                continue
            staleness = self.version - group.oldest_version()
            if staleness > lcfg.max_staleness:
                self.counts["stale"] += 1
                bridge.call(bridge.consumer.dead_letter(entry_id, data, "stale", f"staleness {staleness}"))
                continue
            ids.append(entry_id)
            groups.append(group)
        return ids, groups

    def run(self) -> None:
        cfg, lcfg = self.cfg, self.cfg.learner
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        torch.manual_seed(lcfg.seed)
        torch.set_num_threads(lcfg.threads)
        model = load_causal_lm(cfg.model.path, cfg.model.dtype)
        trainer = Trainer(model, lcfg)
        keys = Keys(cfg.redis.run)
        bridge = BrokerBridge(cfg.redis.url, keys, consumer=f"learner-{socket.gethostname()}",
                              keep_versions=lcfg.keep_versions, queue_size=2 * lcfg.groups_per_step,
                              read_count=lcfg.groups_per_step).start()
        latest = bridge.call(bridge.store.latest())
        if latest is None:
            bridge.call(bridge.store.publish(0, 0, trainer.weights_blob()))
        else:
            self.version = latest["version"]
        sink = JsonlSink(Path(cfg.run.run_dir) / "metrics.jsonl")
        log.info("learner ready: version %d, %d steps of %d groups", self.version, lcfg.steps, lcfg.groups_per_step)
        last = time.monotonic()
        try:
            for step in range(1, lcfg.steps + 1):
                ids, groups = self._next_groups(bridge)
                if self.stopping:
                    break
                record = self._step(trainer, bridge, step, groups)
                bridge.call(bridge.consumer.ack(ids))
                self.seen.update(g.group_id for g in groups)
                now = time.monotonic()
                record["perf/step_s"] = now - last
                record["perf/groups_per_s"] = len(groups) / (now - last)
                record["perf/tokens_per_s"] = record["batch/generated_tokens"] / (now - last)
                last = now
                sink.write(record)
                log.info("step %d reward %.3f groups/s %.2f tokens/s %.0f version %d staleness %.2f",
                         step, record["reward/mean"], record["perf/groups_per_s"], record["perf/tokens_per_s"],
                         self.version, record["staleness/mean"])
        finally:
            sink.close()
            bridge.stop()
        log.info("learner done at version %d", self.version)

    def _step(self, trainer: Trainer, bridge: BrokerBridge, step: int, groups: list[RolloutGroup]) -> dict:
        lcfg = self.cfg.learner
        batch = collate(groups, scale_by_std=lcfg.algorithm == "grpo")
        staleness = np.array([self.version - g.oldest_version() for g in groups])
        metrics = trainer.train_step(batch)
        if step % lcfg.publish_every == 0:
            self.version += 1
            t0 = time.perf_counter()
            bridge.call(bridge.store.publish(self.version, step, trainer.weights_blob()))
            metrics["learner/time/publish_s"] = time.perf_counter() - t0
        self.counts["zero_signal"] += int((~batch.group_signal).sum())
        generated = np.concatenate([s.versions[s.loss_mask.astype(bool)] for g in groups for s in g.samples])
        return {
            "step": step,
            "weight_version": self.version,
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()),
            "batch/groups": len(groups),
            "batch/zero_signal_frac": float((~batch.group_signal).mean()),
            "batch/generated_tokens": int(generated.size),
            "batch/version_min": int(generated.min()) if generated.size else -1,
            "batch/version_max": int(generated.max()) if generated.size else -1,
            "staleness/mean": float(staleness.mean()),
            "staleness/max": int(staleness.max()),
            "staleness/hist": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))},
            "broker/duplicates": self.counts["duplicates"],
            "broker/stale": self.counts["stale"],
            "broker/dead_letters_invalid": bridge.dead_letters,
            **metrics,
        }


def main(cfg: Config) -> None:
    os.makedirs(cfg.run.run_dir, exist_ok=True)
    Learner(cfg).run()
