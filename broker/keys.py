"""Every Redis key name of a run, in one place. All keys of a run share the hash tag
``{run}`` so a run works unchanged on Redis Cluster."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Keys:
    run: str

    @property
    def prefix(self) -> str:
        return f"omrl:{{{self.run}}}"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def consumer_group(self) -> str:
        return "learner"

    @property
    def weights_latest(self) -> str:
        """Hash: the latest published version's record."""
        return f"{self.prefix}:weights:latest"

    @property
    def weights_channel(self) -> str:
        """Pub/sub channel announcing each new version."""
        return f"{self.prefix}:weights:announce"

    def weights_blob(self, version: int) -> str:
        return f"{self.prefix}:weights:blob:{version}"
