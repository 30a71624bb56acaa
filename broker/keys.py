"""Every Redis key name of a run, in one place. Run-level keys share the hash tag ``{run}``
so a run works unchanged on Redis Cluster (multi-key commands and Lua need one slot).
With N shards, rollout stream i is ``omrl:{run:qi}:rollouts``: its own tag, so the streams
spread over the cluster's nodes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Keys:
    run: str
    shards: int = 1

    @property
    def prefix(self) -> str:
        return f"omrl:{{{self.run}}}"

    def rollouts(self, shard: int = 0) -> str:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} out of range 0..{self.shards - 1}")
        return f"{self.prefix}:rollouts" if self.shards == 1 else f"omrl:{{{self.run}:q{shard}}}:rollouts"

    def space_doorbell(self, shard: int = 0) -> str:
        """List: tokens rung when rollout stream `shard` frees space (broker/doorbell.py); the stream's slot."""
        return f"{self.rollouts(shard)}:doorbell"

    @property
    def streams(self) -> list[str]:
        return [self.rollouts(i) for i in range(self.shards)]

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    consumer_group: str = "learner"

    @property
    def weights_latest(self) -> str:
        """Hash: the latest published version's record."""
        return f"{self.prefix}:weights:latest"

    @property
    def weights_channel(self) -> str:
        """Pub/sub channel announcing each new version."""
        return f"{self.prefix}:weights:announce"

    @property
    def weights_kept(self) -> str:
        """Sorted set: the versions whose bytes are kept (the newest `learner.keep_versions`)."""
        return f"{self.prefix}:weights:kept"

    def weights_chunk(self, version: int, index: int) -> str:
        """String: one chunk of a version's blob (the blob transport through Redis)."""
        return f"{self.prefix}:weights:blob:{version}:{index}"

    def weights_record(self, version: int) -> str:
        """Hash: a kept version's record (what `weights_latest` held when it was the newest)."""
        return f"{self.prefix}:weights:record:{version}"

    @property
    def learner_state(self) -> str:
        """Hash: the learner's step and version, for `omrl status`."""
        return f"{self.prefix}:learner:state"

    @property
    def tickets_held(self) -> str:
        """Sorted set: admission tickets of groups running now, scored by their expiry time."""
        return f"{self.prefix}:tickets:held"

    @property
    def tickets_lost(self) -> str:
        """Sorted set: tickets that came back because their actor was presumed dead, scored by when."""
        return f"{self.prefix}:tickets:lost"

    @property
    def tickets_accepted(self) -> str:
        """Counter of groups written to the streams and not dead-lettered: the admission bound's other half."""
        return f"{self.prefix}:tickets:accepted"

    @property
    def tickets_doorbell(self) -> str:
        """List: tokens rung when admission tickets become available (broker/doorbell.py)."""
        return f"{self.prefix}:tickets:doorbell"

    @property
    def counts(self) -> str:
        """Hash of monotonic counters: started, produced, failed:<reason>, dead:<reason>."""
        return f"{self.prefix}:counts"

    @property
    def evals(self) -> str:
        """Stream of evaluation results on held-out tasks (one JSON record per evaluation)."""
        return f"{self.prefix}:eval"

    @property
    def eval_claims(self) -> str:
        """Hash: evaluation slot (versions slot * eval_every ...) -> the evaluator that took it
        (":done" once published); the newest broker.evals.CLAIMS_KEPT slots."""
        return f"{self.prefix}:eval:claims"

    @property
    def members(self) -> str:
        """Hash: member id -> last heartbeat record."""
        return f"{self.prefix}:members"

    @property
    def actor_slots(self) -> str:
        """Hash: actor name -> "index starts renewed_at": the index an actor without one of its
        own (a scaled replica) seeds from."""
        return f"{self.prefix}:actors:slots"
