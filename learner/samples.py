"""What the model says: every `learner.samples_every` steps, `learner.samples_per_step` episodes of
the step's batch (its best, its worst, the rest drawn at random) are kept in RUN_DIR/samples.jsonl,
one JSON object each, turn by turn: the text, the token ids and, on the model's turns, each
token's behaviour log-prob, weight version and advantage, with the episode's rewards. The file
is bounded: past `learner.samples_max_mb` it becomes samples.1.jsonl (the older one is dropped),
so the two hold about twice that.
`omrl view RUN_DIR` browses them; the metrics sinks get them as text."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from common.messages import RolloutGroup
from common.metrics import append_jsonl, read_jsonl

FILE, ROTATED = "samples.jsonl", "samples.1.jsonl"


def turns_of(sample, advantages: np.ndarray | None, decode, pieces) -> list[dict[str, Any]]:
    """The sample cut where its loss mask changes: context (the prompt, then each observation)
    and the model's turns, each with its text, token ids and each token's own text (`pieces`,
    for colouring tokens); the model's also with per-token log-probs, versions and advantages
    (rounded: this is for reading, not for training)."""
    mask = sample.loss_mask.astype(bool)
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    turns, contexts = [], 0
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(mask)]):
        ids = sample.tokens[a:b]
        turn: dict[str, Any] = {"text": decode(ids), "tokens": ids.tolist(), "pieces": pieces(ids)}
        if mask[a]:
            turn.update(role="model", logprobs=np.round(sample.logprobs[a:b], 4).tolist(),
                        versions=sample.versions[a:b].tolist(),
                        advantages=None if advantages is None else np.round(advantages[a:b], 4).tolist())
        else:
            turn["role"] = "prompt" if contexts == 0 else "observation"
            contexts += 1
        turns.append(turn)
    return turns


def choose(rewards: list[float], count: int, rng: random.Random) -> list[tuple[int, str]]:
    """(index, why) of `count` episodes: the best, the worst, then others at random."""
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])
    picked = [(order[-1], "best")]
    if len(order) > 1 and count > 1:
        picked.append((order[0], "worst"))
    rest = [i for i in range(len(rewards)) if i not in {p for p, _ in picked}]
    picked += [(i, "random") for i in rng.sample(rest, min(len(rest), count - len(picked)))]
    return picked[:count]


class SampleKeeper:
    def __init__(self, run_dir: str | Path, tokenizer_path: str, every: int, count: int, max_mb: float, seed: int = 0):
        self.path = Path(run_dir) / FILE
        self.every, self.count, self.max_bytes = every, count, int(max_mb * (1 << 20))
        self.rng = random.Random(seed)
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self._tokenizer

    def _decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist())

    def _pieces(self, ids: np.ndarray) -> list[str]:
        return self.tokenizer.batch_decode([[i] for i in ids.tolist()])

    def keep(self, step: int, version: int, groups: list[RolloutGroup], batch, staleness: list[int],
             advantages_known: bool = True) -> list[dict]:
        """Choose and write the step's episodes. `batch` is the step's (its rows in the groups'
        sample order); `staleness` each group's, in optimizer steps; `advantages_known`: False
        where this rank did not compute every sample's advantages (a critic over several ranks),
        and the episodes say null."""
        rows, offset = [], 0  # each episode: its group, the group's index, and its segments' (batch row, sample)
        for gi, g in enumerate(groups):
            members: dict[int, list] = {}  # by the episode's position; a segment's batch row is its sample's
            for i, (position, s) in enumerate(zip(g.episode_positions(), g.samples)):
                members.setdefault(position, []).append((offset + i, s))
            rows += [(g, gi, segments) for segments in members.values()]
            offset += len(g.samples)
        kept, run = [], uuid.uuid4().hex[:6]  # ids stay unique when a restarted learner keeps a step again
        for j, (i, why) in enumerate(choose([segments[0][1].reward for _g, _gi, segments in rows], self.count,
                                            self.rng)):
            group, gi, segments = rows[i]
            sample = segments[0][1]
            turns = []  # an agent's episode cut into segments: each segment's turns, in order
            for r, segment in segments:
                adv = batch.advantages[r, :len(segment.tokens)].float().numpy() if advantages_known else None
                turns += turns_of(segment, adv, self._decode, self._pieces)
            kept.append({
                "id": f"{step}-{j}-{run}", "step": step, "weight_version": version, "why": why,
                "trained": any(bool(batch.loss_mask[r].any()) for r, _s in segments), "group_id": group.group_id,
                "actor_id": group.actor_id, "task_id": sample.task_id, "env_name": sample.env_name,
                "reward": float(sample.reward), "success": bool(sample.success),
                "turn_rewards": [float(t) for _r, s in segments for t in s.turn_rewards],
                "finish_reason": sample.finish_reason,
                "invalid_actions": sum(int(s.invalid_actions) for _r, s in segments), "staleness": int(staleness[gi]),
                "group_rewards": [float(e[0].reward) for e in group.by_episode()],  # as sent, as "reward" is
                "segments": len(segments),
                "turns": turns,
            })
        lines = "".join(json.dumps(k) + "\n" for k in kept)
        if self.path.exists() and self.path.stat().st_size + len(lines) > self.max_bytes:
            self.path.replace(self.path.with_name(ROTATED))
        with append_jsonl(self.path) as f:
            f.write(lines)
        return kept


def as_text(kept: list[dict[str, Any]]) -> dict[str, str]:
    """The step's kept episodes by tag (samples/best, samples/worst, samples/random-1, ...) as text."""
    tags, randoms = {}, 0
    for episode in kept:
        randoms += episode["why"] == "random"
        tags[f"samples/{episode['why']}" + (f"-{randoms}" if episode["why"] == "random" else "")] = as_markdown(episode)
    return tags


def as_markdown(episode: dict[str, Any]) -> str:
    """One kept episode as text for TensorBoard and W&B: its header, then each turn."""
    head = (f"**{episode['why']}** · reward {episode['reward']:.3f} · success {episode['success']} · task "
            f"{episode['task_id']} ({episode['env_name']}) · step {episode['step']}, staleness {episode['staleness']}")
    body = [f"*{t['role']}*: " + t["text"].replace("\n", "  \n") for t in episode["turns"]]
    return "\n\n".join([head, *body])


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every kept episode of a run, oldest first (the rotated file, then the current one); a line
    still being written is left out."""
    paths = [Path(run_dir) / ROTATED, Path(run_dir) / FILE]
    return [row for p in paths if p.exists() for row in read_jsonl(p)]
