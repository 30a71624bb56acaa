"""Rollout groups for tests, built in memory (pure: no Redis, no model)."""

import numpy as np

from common.messages import RolloutGroup, Sample


def synthetic_group(rng: np.random.Generator) -> RolloutGroup:
    samples = []
    for _ in range(4):
        n_prompt, n_gen = 6, 4
        reward = float(rng.random())
        samples.append(Sample(
            tokens=rng.integers(0, 80, n_prompt + n_gen).astype(np.int32),
            loss_mask=np.array([0] * n_prompt + [1] * n_gen, np.uint8),
            logprobs=np.array([0.0] * n_prompt + [-4.4] * n_gen, np.float32),
            versions=np.array([-1] * n_prompt + [0] * n_gen, np.int32),
            reward=reward, turn_rewards=np.array([reward], np.float32), num_turns=1,
            finish_reason="done", task_id="0", env_name="synthetic"))
    return RolloutGroup(task_id="0", env_name="synthetic", actor_id="test", sampling={}, samples=samples)


def varied_group(rng: np.random.Generator, size: int = 4) -> RolloutGroup:
    """Samples of 12 to 60 tokens (the generated part 4 to 30), so ranks and micro-batches get
    unequal shares and some ranks idle through a pass."""
    samples = []
    for _ in range(size):
        n_prompt, n_gen = int(rng.integers(8, 31)), int(rng.integers(4, 31))
        reward = float(rng.random())
        loss_mask = np.array([0] * n_prompt + [1] * n_gen, np.uint8)
        samples.append(Sample(
            tokens=rng.integers(0, 80, n_prompt + n_gen).astype(np.int32), loss_mask=loss_mask,
            logprobs=np.where(loss_mask, rng.normal(-4.4, 0.3, n_prompt + n_gen), 0).astype(np.float32),
            versions=np.array([-1] * n_prompt + [0] * n_gen, np.int32),
            reward=reward, turn_rewards=np.array([reward], np.float32), num_turns=1,
            finish_reason="done", task_id="0", env_name="synthetic"))
    return RolloutGroup(task_id="0", env_name="synthetic", actor_id="test", sampling={"temperature": 0.8},
                        samples=samples)


def sft_examples(rng: np.random.Generator, n: int = 12) -> list[tuple[np.ndarray, np.ndarray]]:
    """Episodes (tokens, loss_mask) of 12 to 60 tokens, each a prompt then two trained answers
    around an observation, as `learner.sft.read_examples` gives them, for the learner's
    supervised term (learner.sft_coef)."""
    out = []
    for _ in range(n):
        prompt, answer, obs = (int(rng.integers(4, 13)), int(rng.integers(2, 13)), int(rng.integers(2, 11)))
        mask = [0] * prompt + [1] * answer + [0] * obs + [1] * answer
        out.append((rng.integers(0, 80, len(mask)).astype(np.int32), np.array(mask, np.uint8)))
    return out


def multi_turn_sample(rng: np.random.Generator, turn_rewards: list[float], states: list[str], reward: float | None = None,
                      version: int = 0, gen: int = 3, context: int = 4) -> Sample:
    """A prompt, then per turn `gen` generated tokens and `context` observation tokens (none
    after the last); the reward is the turn rewards' sum unless given."""
    mask = [0] * context
    for k in range(len(turn_rewards)):
        mask += [1] * gen + ([0] * context if k < len(turn_rewards) - 1 else [])
    loss_mask = np.array(mask, np.uint8)
    n = len(mask)
    return Sample(
        tokens=rng.integers(0, 80, n).astype(np.int32), loss_mask=loss_mask,
        logprobs=np.where(loss_mask, rng.normal(-4.4, 0.3, n), 0).astype(np.float32),
        versions=np.where(loss_mask, version, -1).astype(np.int32),
        reward=float(sum(turn_rewards) if reward is None else reward),
        turn_rewards=np.array(turn_rewards, np.float32), num_turns=len(turn_rewards),
        finish_reason="done", task_id="0", env_name="synthetic", turn_states=list(states))


def multi_turn_group(rng: np.random.Generator, episodes: list[tuple[list[float], list[str]]], version: int = 0
                     ) -> RolloutGroup:
    return RolloutGroup(task_id="0", env_name="synthetic", actor_id="test", sampling={},
                        samples=[multi_turn_sample(rng, r, s, version=version) for r, s in episodes])


def mask_generated(s: Sample, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Mask each generated token of `s` but the last (a choice complete) to itself and up to 4
    other ids below 80, as the actors' masks send them (Sample.allowed_counts, Sample.allowed);
    returns each masked position's allowed ids."""
    gen = np.flatnonzero(s.loss_mask)[:-1]
    ids = [np.concatenate([[s.tokens[t]], rng.choice([v for v in range(80) if v != s.tokens[t]],
                                                     int(rng.integers(0, 5)), replace=False)]).astype(np.int32)
           for t in gen]
    s.allowed_counts = np.zeros(len(s.tokens), np.int32)
    s.allowed_counts[gen] = [len(i) for i in ids]
    s.allowed = np.concatenate(ids)
    return dict(zip(gen.tolist(), ids))
