"""The learner process shell: signals, broker reads (through the bridge thread), weight
publication, checkpoints, acknowledgements and metrics around the pure training step.

Exactly-once training on at-least-once delivery: the newest group ids trained on are
recorded in the checkpoint, groups are acknowledged only after the checkpoint that holds
them, and a group whose id was already trained on is acknowledged and skipped.

On SIGTERM or SIGINT the learner finishes the step it is in, commits what it trained on
(checkpoint, then acknowledgements) and exits with 128 + the signal's number; it exits 0
only when it reached `learner.steps`, so a supervisor can tell "done" from "stopped".

With several ranks (torchrun), rank 0 is this shell; it tells the other ranks each
operation that holds collectives (restore, train on these groups, gather the weights or
the checkpoint state, stop) and runs it with them. The other ranks only follow.
"""

from __future__ import annotations

import copy
import logging
import os
import resource
import signal
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import msgpack
import numpy as np
import torch

from broker.admission import announce_step
from broker.weights import STAGING, WeightStore
from common.config import Config, require_set
from common.liveness import beat
from common.messages import RolloutGroup, decode_group
from common.metrics import Sinks
from common.models import save_policy
from common.weight_sync import Packed
from learner.batch import Batch, collate, group_advantages
from learner.bridge import BrokerBridge, Delivery
from learner.broadcast import BroadcastSender
from learner.checkpoint import LearnerState, RecentIds, begin, finish, latest_checkpoint, read_state
from learner.distributed import Single, setup
from learner.host_memory import return_freed_memory
from learner.samples import SampleKeeper, as_text
from learner.sft import read_examples
from learner.trainer import REFERENCE_DTYPE, Trainer

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, cfg: Config):
        require_set(cfg, "model.path", "redis.url")
        self.cfg = cfg
        self.stopped_by: int | None = None  # the signal that asked the learner to stop
        self.state = LearnerState()
        self.seen = RecentIds(cfg.learner.dedup_window)  # every group trained on, committed or not
        self.uncommitted: list[Delivery] = []  # trained on, not yet in a checkpoint
        self.counts = {"duplicates": 0, "stale": 0}
        self.filtered_now = 0  # groups without signal filtered while this step's were read (learner.filter_groups)
        self.evals: list[dict] = []  # evaluations arrived and not yet in a step record
        self.checkpoint_dir = Path(cfg.run.run_dir) / "checkpoints"
        lcfg = cfg.learner
        self.keeper = SampleKeeper(cfg.run.run_dir, cfg.model.path, lcfg.samples_every, lcfg.samples_per_step,
                                   lcfg.samples_max_mb, lcfg.seed)
        self.parallel: Single | None = None
        self.trainer: Trainer | None = None
        self.saving: tuple[Future, Path, LearnerState, list[Delivery]] | None = None  # rank 0: a checkpoint
        # being written (every rank's shards done when the future is), its directory, state and groups
        self.writing: Future | None = None  # every rank: its own shards of the newest checkpoint being written
        self.checkpoint_s = 0.0  # time the last checkpoint held the training loop
        self.sender: BroadcastSender | None = None  # weights.transport = "broadcast": rank 0's sender
        self.ops = {"restore": self._op_restore, "train": self._op_train, "weights": self._op_weights,
                    "checkpoint": self._op_checkpoint, "final": self._op_final}

    # -- operations every rank runs together ---------------------------------------------
    def _all(self, op: str, payload=None, local=None):
        """Rank 0: have every other rank run `op` too, then run it here (on `local`, if given: the
        payload as rank 0 already holds it, which the others get as `payload`'s bytes)."""
        if self.parallel.world > 1:
            self.parallel.broadcast_bytes(msgpack.packb({"op": op, "payload": payload}, use_bin_type=True))
        return self.ops[op](payload if local is None else local)

    def _follow(self) -> int:
        """Ranks > 0: run what rank 0 says until it says stop."""
        # The signal goes to every rank; rank 0 decides when to stop and tells the others.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            msg = msgpack.unpackb(self.parallel.broadcast_bytes(None), raw=False)
            if msg["op"] == "stop":
                self._written()
                return int(msg["payload"])
            self.ops[msg["op"]](msg["payload"])

    def _op_restore(self, path: str | None) -> LearnerState | None:
        if path is None:
            return None
        self.trainer.load_checkpoint(Path(path))
        return read_state(Path(path)) if self.parallel.is_main else None

    def _op_train(self, payload: dict) -> tuple[dict, Batch]:
        """payload: the groups' messages (rank 0: the groups its intake decoded already) and which
        of their samples are stale (rank 0 knows it)."""
        lcfg = self.cfg.learner
        groups = [g if isinstance(g, RolloutGroup) else decode_group(g) for g in payload["groups"]]
        batch = collate(groups, lcfg.algorithm, stale=payload["stale"],
                        gamma=lcfg.gamma, step_weight=lcfg.gigpo_step_weight, loss_agg=lcfg.loss_agg,
                        negative_weight=lcfg.negative_weight, refused_turns=lcfg.refused_turns,
                        refused_reward=lcfg.refused_reward)
        return self.trainer.train_step(batch), batch

    def _op_weights(self, _=None) -> str | Packed | None:
        """Rank 0: the weights for the actors, as a safetensors file's path (blob: written as they
        are gathered, for `WeightStore.publish` to take) or packed buckets (broadcast)."""
        # In the actors' inference dtype: vLLM would cast fp32 on load anyway, and bf16 halves the bytes.
        dtype, wcfg = getattr(torch, self.cfg.model.dtype), self.cfg.weights
        if wcfg.transport == "blob":
            path = os.path.join(wcfg.dir or self.cfg.run.run_dir, STAGING)
            if self.parallel.is_main:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            self.trainer.save_weights(path, dtype)
            return path
        # In host memory: the sender thread sends from it over gloo while training goes on.
        return self.trainer.weights_packed(self.state.version, dtype, wcfg.bucket_mb << 20, torch.device("cpu"))

    def _op_checkpoint(self, payload: dict) -> Future:
        """payload: the directory and whether to write in the background. One checkpoint in flight:
        this rank's part of the previous one is written first (rank 0 has waited for it already)."""
        self._written()
        self.writing = self.trainer.save_checkpoint(Path(payload["path"]), payload["background"])
        return self.writing

    def _written(self) -> None:
        """Wait for this rank's part of the checkpoint being written, if one is."""
        writing, self.writing = self.writing, None
        if writing is not None:
            writing.result()  # a failed write fails the learner: its groups stay pending, nothing is lost

    def _op_final(self, _=None) -> Path:
        """The trained weights with the tokenizer, as a Hugging Face model directory."""
        state = self.trainer.hf_state()
        final = Path(self.cfg.run.run_dir) / "final"
        if self.parallel.is_main:
            save_policy(self.trainer.model, self.cfg.model.path, final, state_dict=state)
        return final

    def _on_signal(self, signum, frame) -> None:
        log.info("signal %d: stopping after this step, committing what was trained on", signum)
        self.stopped_by = signum

    @property
    def stopping(self) -> bool:
        return self.stopped_by is not None

    def _next_groups(self, bridge: BrokerBridge) -> list[Delivery]:
        """B usable groups; duplicates are acknowledged, stale ones dead-lettered and, with
        learner.filter_groups, those without signal filtered (counted in `filtered_now`)."""
        lcfg = self.cfg.learner
        self.filtered_now = 0
        batch: list[Delivery] = []
        while len(batch) < lcfg.groups_per_step and not self.stopping:
            beat()  # waiting for groups is progress: the actors' pace is theirs (common/liveness.py)
            self._acknowledge_saved(bridge, wait=False)  # a background checkpoint may have ended meanwhile
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
            staleness = self.state.steps_behind(d.group.oldest_version())
            log.debug("group %s from %s: staleness %d steps", gid, d.group.actor_id, staleness)
            if staleness > lcfg.max_staleness:
                self.counts["stale"] += 1
                bridge.dead_letter(d, "stale", f"staleness {staleness} steps > learner.max_staleness "
                                               f"{lcfg.max_staleness}")
                continue
            if lcfg.filter_groups and not group_advantages([d.group], lcfg.algorithm, lcfg.gamma,
                                                           lcfg.refused_reward)[2][0]:
                self.filtered_now += 1
                bridge.filter(d, "no_signal")  # its ticket comes back: the actors play another
                continue
            batch.append(d)
        return batch

    def _publish(self, bridge: BrokerBridge) -> None:
        store: WeightStore = bridge.store
        weights = self._all("weights")
        version, step = self.state.version, self.state.step
        self.state.published_now(keep=self.cfg.learner.max_staleness + 2)
        keys = bridge.keys
        trained = self.state.groups_trained
        # broadcast: each actor's link sends it when the actor asks
        record = self.sender.publish(weights, step) if isinstance(weights, Packed) else None

        async def publish():
            if record is not None:
                await store.announce(record)
            else:
                await store.publish(version, step, weights)
            await announce_step(bridge.client, keys, step, version, trained, self.cfg.learner.groups_per_step,
                                self.cfg.learner.steps_ahead)

        bridge.call(publish, "publish weights")

    def _commit(self, bridge: BrokerBridge, background: bool) -> None:
        """Checkpoint what was trained on; acknowledge its groups once the checkpoint is durable
        (now, or when the background write ends: `_acknowledge_saved`)."""
        t0 = time.perf_counter()
        self._acknowledge_saved(bridge, wait=True)  # at most one checkpoint in flight
        self.state.trained_ids = self.seen.to_list()
        state, deliveries, self.uncommitted = copy.deepcopy(self.state), self.uncommitted, []
        path = begin(self.checkpoint_dir, state.step)
        future = self._all("checkpoint", {"path": str(path), "background": background})
        self.saving = (future, path, state, deliveries)
        if not background:
            self._acknowledge_saved(bridge, wait=True)
        self.checkpoint_s = time.perf_counter() - t0

    def _acknowledge_saved(self, bridge: BrokerBridge, wait: bool) -> None:
        if self.saving is None or not (wait or self.saving[0].done()):
            return
        (_, path, state, deliveries), self.saving = self.saving, None
        self._written()  # rank 0's future: every rank's shards and the metadata are written
        finish(path, state, self.cfg.learner.keep_checkpoints)
        bridge.ack(deliveries)
        keys = bridge.keys
        # For the run's accounting: trained and acknowledged (no longer in a stream).
        bridge.call(lambda: bridge.client.hset(keys.learner_state, "groups_committed", state.groups_trained),
                    "learner state")

    def run(self) -> int:
        """Train to learner.steps (exit code 0) or until a signal (128 + its number)."""
        lcfg = self.cfg.learner
        self.parallel = setup(lcfg.parallel, lcfg.device, lcfg.precision, lcfg.vocab_parallel)
        torch.manual_seed(lcfg.seed)
        torch.set_num_threads(lcfg.threads)
        return_freed_memory(lcfg.return_freed_memory)
        # fp32 master weights whatever model.dtype (the actors' inference dtype) says; learner.precision
        # sets the compute.
        path = self.cfg.model.path
        reference = self.parallel.load_model(path, REFERENCE_DTYPE[lcfg.precision], trainable=False) \
            if lcfg.kl_coef > 0 else None
        model = self.parallel.load_model(path)
        sft = []
        if lcfg.sft_coef > 0:
            try:
                sft = read_examples(lcfg.sft_data, model.config.vocab_size,
                                    getattr(model.config, "max_position_embeddings", None))
            except ValueError as exc:
                raise SystemExit(f"error: {exc}") from None
            log.info("supervised term (learner.sft_coef = %g): %d episodes of %s", lcfg.sft_coef, len(sft),
                     ", ".join(lcfg.sft_data))
        self.trainer = Trainer(model, lcfg, self.parallel, reference, sft)
        try:
            return self._lead() if self.parallel.is_main else self._follow()
        finally:
            if self.sender is not None:
                self.sender.close()
            self.parallel.close()

    def _lead(self) -> int:
        cfg, lcfg = self.cfg, self.cfg.learner
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        found = latest_checkpoint(self.checkpoint_dir)
        restored = self._all("restore", str(found) if found else None)
        wcfg = cfg.weights
        bridge = BrokerBridge(cfg.redis, consumer=lcfg.consumer, keep_versions=lcfg.keep_versions,
                              queue_size=2 * lcfg.groups_per_step, read_count=lcfg.groups_per_step,
                              chunk_bytes=wcfg.chunk_mb << 20, weights_dir=wcfg.dir,
                              admission=(lcfg.groups_per_step, lcfg.steps_ahead)).start()
        if wcfg.transport == "broadcast":
            self.sender = BroadcastSender(wcfg.host, wcfg.port, wcfg.timeout_s)
            log.info("weights go by broadcast from %s", self.sender.address)
        latest = bridge.call(bridge.store.latest, "read the weight version")
        if restored is not None:
            self.state = restored
            self.seen.add(restored.trained_ids)
            if not restored.published and latest is not None and latest["version"] == restored.version:
                # A checkpoint from before versions' steps were kept: the newest one's is in Redis.
                self.state.published = [[latest["version"], int(latest["step"])]]
        if latest is None or restored is None or latest["version"] != self.state.version:
            # First start, or weights newer than the checkpoint were published before a crash:
            # publish what this learner holds under a fresh version number.
            self.state.version = max(self.state.version, latest["version"] + 1 if latest else 0)
            self._publish(bridge)
        if self.state.step >= lcfg.steps:
            log.warning("the checkpoint in %s is at step %d, learner.steps is %d: nothing to do (use a new run dir "
                        "or raise --steps to continue)", self.checkpoint_dir, self.state.step, lcfg.steps)
        sink = Sinks(cfg.run.run_dir, cfg)
        log.info("learner ready: step %d, version %d, %d steps of %d groups, %d rank(s) (%s) on %s", self.state.step,
                 self.state.version, lcfg.steps, lcfg.groups_per_step, self.parallel.world,
                 lcfg.parallel if self.parallel.world > 1 else "single", self.parallel.device)
        step_times: deque[float] = deque([time.monotonic()], maxlen=2)
        code = 0
        try:
            while self.state.step < lcfg.steps:
                waited = time.monotonic()
                batch = self._next_groups(bridge)
                waited = time.monotonic() - waited
                if self.stopping:
                    break
                self.state.groups_trained += len(batch)
                record, kept = self._step(bridge, batch)
                self.uncommitted += batch
                self.seen.add(d.group.group_id for d in batch)
                step_times.append(time.monotonic())
                dt = step_times[1] - step_times[0]
                record.update(self._evals(bridge))
                record.update({"time": time.time(), "perf/step_s": dt, "perf/wait_s": waited,
                               "perf/checkpoint_s": self.checkpoint_s, **self._memory(),
                               "perf/groups_per_s": len(batch) / dt,
                               "perf/tokens_per_s": record["batch/generated_tokens"] / dt,
                               "batch/group_ids": [d.group.group_id for d in batch]})
                # The record before the checkpoint: a crash between them trains the step again and
                # writes its record twice (the last one counts), never a checkpointed step without one.
                sink.write(record)
                beat()
                if kept:
                    sink.text(record["step"], as_text(kept))
                self.checkpoint_s = 0.0
                if self.state.step % lcfg.checkpoint_every == 0 or self.state.step == lcfg.steps:
                    self._commit(bridge, background=lcfg.checkpoint_async and self.state.step < lcfg.steps)
                self._acknowledge_saved(bridge, wait=False)
                log.info("step %d reward %.3f groups/s %.2f tokens/s %.0f version %d staleness %.2f",
                         self.state.step, record["reward/mean"], record["perf/groups_per_s"],
                         record["perf/tokens_per_s"], self.state.version, record["staleness/mean"])
            if self.uncommitted:  # stopped between checkpoints: clean stops lose nothing
                self._commit(bridge, background=False)
            self._acknowledge_saved(bridge, wait=True)
            if self.stopping and self.state.step < lcfg.steps:
                code = 128 + self.stopped_by
                log.info("stopped by signal %d at step %d, version %d (committed)", self.stopped_by, self.state.step,
                         self.state.version)
            else:
                final = self._all("final")
                log.info("learner done at step %d, version %d; the trained model is in %s (omrl eval --model %s)",
                         self.state.step, self.state.version, final, final)
        finally:
            sink.close()
            bridge.stop()
        if self.parallel.world > 1:
            self.parallel.broadcast_bytes(msgpack.packb({"op": "stop", "payload": code}))
        return code

    def _memory(self) -> dict[str, float]:
        """Rank 0's peak memory so far: resident (ru_maxrss, KiB on Linux) and, on a GPU, allocated."""
        peak = {"perf/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}
        if self.parallel.device.type == "cuda":
            peak["perf/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
        return peak

    def _evals(self, bridge: BrokerBridge) -> dict:
        """One evaluation a step record, as eval/* metrics: of those arrived and not yet recorded,
        the one of the lowest version (several evaluators may finish within one step: the others
        go into the next steps' records)."""
        while bridge.evals:  # the bridge thread appends; pop is atomic
            self.evals.append(bridge.evals.pop(0))
        if not self.evals:
            return {}
        first = min(range(len(self.evals)), key=lambda i: self.evals[i]["version"])
        return {f"eval/{k}": v for k, v in self.evals.pop(first).items()}

    def _keep_samples(self, groups: list[RolloutGroup], batch: Batch, staleness: np.ndarray, metrics: dict) -> list[dict]:
        """The step's kept episodes (learner/samples.py), timed; a failure to keep them costs a
        warning, never the step."""
        started = time.perf_counter()
        try:  # with a critic over several ranks, this rank has only its own samples' advantages
            return self.keeper.keep(self.state.step, self.state.version, groups, batch, staleness.tolist(),
                                    advantages_known=not (self.trainer.critic and self.parallel.world > 1))
        except Exception as exc:  # noqa: BLE001 - a sample file must not stop training
            log.warning("could not keep the step's episodes in %s: %s: %s", self.keeper.path, type(exc).__name__, exc)
            return []
        finally:
            metrics["learner/time/samples_s"] = time.perf_counter() - started

    def _step(self, bridge: BrokerBridge, deliveries: list[Delivery]) -> tuple[dict, list[dict]]:
        """One training step: its metrics record, and the episodes it kept (learner/samples.py)."""
        lcfg = self.cfg.learner
        groups = [d.group for d in deliveries]
        # In optimizer steps: how many updates the weights that generated a group's oldest token lag behind.
        staleness = np.array([self.state.steps_behind(g.oldest_version()) for g in groups])
        stale = [not self.state.fresh(s.oldest_version()) for g in groups for s in g.samples]
        metrics, batch = self._all("train", {"groups": [d.data for d in deliveries], "stale": stale},
                                   local={"groups": groups, "stale": stale})
        self.state.step += 1
        if self.state.step % lcfg.publish_every == 0:
            self.state.version += 1
            t0 = time.perf_counter()
            self._publish(bridge)
            metrics["learner/time/publish_s"] = time.perf_counter() - t0
        if self.sender is not None:  # broadcast: members, copies sent out of this process, versions delivered
            metrics.update({"weights/members": len(self.sender.members), "weights/sends": self.sender.sends,
                            "weights/sent": self.sender.sent, "weights/groups": self.sender.epochs})
        kept = self._keep_samples(groups, batch, staleness, metrics) if self.keeper.due(self.state.step) else []
        generated = np.concatenate([s.versions[s.loss_mask.astype(bool)] for g in groups for s in g.samples])
        samples = [s for g in groups for s in g.samples]
        episodes = [segments for g in groups for segments in g.by_episode()]  # an agent's segments: one episode
        turns = sum(s.num_turns for s in samples)
        record = {
            "step": self.state.step,
            "weight_version": self.state.version,
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()),
            "reward/env": float(np.mean([sum(s.turn_rewards.sum() for s in e) for e in episodes])),
            "reward/success": float(np.mean([e[0].success for e in episodes])),
            "actor/invalid_action_frac": sum(s.invalid_actions for s in samples) / max(1, turns),
            "actor/refused_turn_frac": sum(len(s.refused_turns) for s in samples) / max(1, turns),
            "batch/turns_mean": turns / len(episodes),
            "batch/segments_per_episode": len(samples) / len(episodes),
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
            "broker/filtered": dict(bridge.filtered),
            "batch/filtered": self.filtered_now,
            **metrics,
        }
        return record, kept


def main(cfg: Config) -> int:
    os.makedirs(cfg.run.run_dir, exist_ok=True)
    return Learner(cfg).run()
