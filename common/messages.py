"""The rollout-group message and its msgpack codec.

One wire format, msgpack, never pickle. A group travels as columns: each per-token array of
every sample concatenated into one array (the samples' turn rewards too), and each per-sample
field (the samples' lengths, numbers, strings, maps) in one list. Arrays travel as
``[dtype, length, bytes]`` with little-endian raw bytes and are decoded with
``np.frombuffer`` (no copy beyond msgpack's own); a sample's arrays are views into its
group's columns. So a group costs a fixed number of array operations whatever its sample
count and length: no per-token and little per-sample Python work on either side.

Every message carries ``kind`` and ``schema_version``; decoding checks both, checks every
array's dtype and byte length against its declared length, checks that the columns agree
with the samples' lengths and counts, checks the values (masks 0 or 1, no NaN or infinite
log-prob or reward) once per column, names the sample a failed check points to, and refuses
payloads over a size limit before unpacking them.

This module imports neither torch nor vLLM so every process can import it cheaply.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import time
import uuid
from typing import Any

import msgpack
import numpy as np

KIND_ROLLOUT_GROUP = "rollout_group"
SCHEMA_VERSION = 7  # 2: samples carry success and invalid_actions; 3: turn_states; 4: samples as columns;
# 5: the episode each sample is a segment of; 6: refused_turns; 7: allowed_counts and allowed (optional columns)
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

# Per-token arrays of a sample, with the dtype they travel as.
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
}
# Per-sample fields, one list each over the group's samples, with the type of its items
# (msgpack decodes a list of a few numbers faster than numpy reads a few bytes).
SAMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "lengths": (int,),  # tokens of each sample
    "num_turns": (int,),  # turn rewards of each sample
    "reward": (float, int),
    "success": (bool,),
    "invalid_actions": (int,),
    "finish_reason": (str,),
    "task_id": (str,),
    "env_name": (str,),
    "turn_states": (list,),
    "refused_turns": (list,),
    "timing": (dict,),
    "episode": (int,),
}
ALLOWED_DTYPE = np.dtype("<i4")  # Sample.allowed_counts and Sample.allowed
SAMPLE_LISTS = {name: frozenset(types) for name, types in SAMPLE_TYPES.items()}  # for the checks


class CodecError(ValueError):
    """A message that cannot be decoded or fails validation; the text says what and where.

    `reason` is short and stable, for dead-letter records: undecodable, oversize, kind,
    schema_version or invalid (which includes NaN or infinite log-probs and rewards).
    """

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class Sample:
    """One episode, token-exact.

    tokens: prompt, generated and observation tokens in order, (T,) int32.
    loss_mask: 1 on generated tokens, 0 on prompt and observation tokens, (T,) uint8.
    logprobs: behaviour log-prob of each generated token, 0 elsewhere, (T,) float32.
    versions: weight version that generated each token, -1 elsewhere, (T,) int32.
    allowed_counts, allowed: the tokens the actor's mask let through at each generated token
    (actor.constrain_actions): how many at each token, (T,) int32, 0 where nothing was masked (and
    on every context token), and their ids, token after token, (allowed_counts.sum(),) int32. None
    where no token was masked. The learner scores each masked token's distribution renormalised
    over its allowed tokens, as the behaviour log-probs were.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    turn_rewards: np.ndarray  # (num_turns,) float32
    num_turns: int
    finish_reason: str
    task_id: str
    env_name: str
    success: bool = False  # the env's success rule (envs.specs)
    invalid_actions: int = 0  # turns whose action did not parse
    turn_states: list[str] = dataclasses.field(default_factory=list)
    """A key of the env state each turn acted in (GiGPO's anchors): equal keys, equal states. One
    per turn, or none where unknown."""
    refused_turns: list[int] = dataclasses.field(default_factory=list)
    """The turns, by index, whose action the env refused (the env spec's `refused` matched the
    observation after it), ascending; none where the env names no pattern or an agent played."""
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    allowed_counts: np.ndarray | None = None
    allowed: np.ndarray | None = None
    episode: int = -1
    """The episode of its group this sample is a segment of: an agent's session whose prompt stopped
    extending its tokens is cut into segments (actors/gateway.py), each a sample with its own prompt,
    every one with its episode's reward. -1: an episode of its own, whole."""

    def oldest_version(self) -> int:
        """The oldest weight version that produced any of its generated tokens (-1 if none)."""
        versions = self.versions[self.loss_mask.astype(bool)]
        return int(versions.min()) if versions.size else -1


@dataclasses.dataclass
class RolloutGroup:
    """G episodes of one task, pushed as one message."""

    task_id: str
    env_name: str
    actor_id: str
    sampling: dict[str, Any]
    samples: list[Sample]
    group_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = dataclasses.field(default_factory=time.time)

    @property
    def rewards(self) -> np.ndarray:
        """(episodes,) each episode's reward, in the order the episodes first appear."""
        return np.array([segments[0].reward for segments in self.by_episode()], dtype=np.float32)

    def by_episode(self) -> list[list[Sample]]:
        """The samples of each episode (its segments, in order), the episodes in the order they first appear."""
        episodes: dict[int, list[Sample]] = {}
        for episode, sample in zip(self.episodes(), self.samples):
            episodes.setdefault(episode, []).append(sample)
        return list(episodes.values())

    def episodes(self) -> list[int]:
        """The episode of each sample: segments of one episode share it, a sample with episode -1
        has one of its own."""
        return [s.episode if s.episode >= 0 else -1 - i for i, s in enumerate(self.samples)]

    def episode_positions(self) -> list[int]:
        """Each sample's episode as a position in `rewards`."""
        episodes = self.episodes()
        order = {e: k for k, e in enumerate(dict.fromkeys(episodes))}
        return [order[e] for e in episodes]

    def oldest_version(self) -> int:
        """The oldest weight version that produced any token of the group (-1 if none)."""
        versions = [v for v in (s.oldest_version() for s in self.samples) if v >= 0]
        return min(versions) if versions else -1


# --- encoding ---------------------------------------------------------------------------


def _pack_array(array: np.ndarray, dtype: np.dtype) -> list[Any]:
    return [dtype.str, int(array.shape[0]), array.astype(dtype, copy=False).tobytes()]


def _column(samples: list[Sample], name: str, dtype: np.dtype) -> list[Any]:
    """One field of every sample, concatenated, as a packed array."""
    try:
        column = np.concatenate([getattr(s, name) for s in samples])
    except ValueError as exc:  # a 0-d array, or arrays of different ranks
        raise CodecError(f"samples' {name}: {exc}") from None
    if column.ndim != 1:
        raise CodecError(f"samples' {name}: arrays must be 1-D, got {column.ndim}-D")
    return _pack_array(column, dtype)


def encode_group(group: RolloutGroup, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    samples = group.samples
    lengths = []
    for i, s in enumerate(samples):  # what the columns cannot say afterwards: which sample is wrong
        try:
            n, turns = len(s.tokens), len(s.turn_rewards)
            if not len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n:
                raise CodecError(f"samples[{i}]: per-token arrays disagree in length: tokens {n}, loss_mask "
                                 f"{len(s.loss_mask)}, logprobs {len(s.logprobs)}, versions {len(s.versions)}")
        except TypeError as exc:  # a scalar where an array belongs
            raise CodecError(f"samples[{i}]: {exc}: arrays must be 1-D") from None
        if turns != s.num_turns:
            raise CodecError(f"samples[{i}]: num_turns={s.num_turns} but {turns} turn rewards")
        if (s.allowed_counts is None) != (s.allowed is None):
            raise CodecError(f"samples[{i}]: allowed_counts and allowed go together (both or neither)")
        if s.allowed_counts is not None and len(s.allowed_counts) != n:
            raise CodecError(f"samples[{i}]: allowed_counts has {len(s.allowed_counts)} items for {n} tokens")
        lengths.append(n)
    columns: dict[str, Any] = {}
    payload = {
        "kind": KIND_ROLLOUT_GROUP,
        "schema_version": SCHEMA_VERSION,
        "group_id": group.group_id,
        "task_id": group.task_id,
        "env_name": group.env_name,
        "actor_id": group.actor_id,
        "created_at": float(group.created_at),
        "sampling": group.sampling,
        "samples": columns,
    }
    columns.update({name: _column(samples, name, dt) for name, dt in TOKEN_ARRAYS.items()})
    if any(s.allowed is not None for s in samples):  # a masked turn somewhere: every sample's counts
        counts = [s.allowed_counts if s.allowed is not None else np.zeros(len(s.tokens), np.int32) for s in samples]
        columns["allowed_counts"] = _pack_array(np.concatenate(counts), ALLOWED_DTYPE)
        columns["allowed"] = _column([s for s in samples if s.allowed is not None], "allowed", ALLOWED_DTYPE)
    columns.update({
        "turn_rewards": _column(samples, "turn_rewards", np.dtype("<f4")),
        "lengths": lengths,
        "num_turns": [int(s.num_turns) for s in samples],
        "reward": [float(s.reward) for s in samples],
        "success": [bool(s.success) for s in samples],
        "invalid_actions": [int(s.invalid_actions) for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        "task_id": [s.task_id for s in samples],
        "env_name": [s.env_name for s in samples],
        "turn_states": [[str(k) for k in s.turn_states] for s in samples],
        "refused_turns": [[int(k) for k in s.refused_turns] for s in samples],
        "timing": [{k: float(v) for k, v in s.timing.items()} for s in samples],
        "episode": [int(s.episode) for s in samples],
    })
    try:
        data = msgpack.packb(payload, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # a field msgpack has no encoding for
        raise CodecError(f"group: {exc}") from None
    if len(data) > max_bytes:
        raise CodecError(f"encoded group is {len(data)} bytes, over the limit of {max_bytes} bytes", "oversize")
    return data


# --- decoding ---------------------------------------------------------------------------


_MISSING = object()


def _field(obj: dict[str, Any], name: str, types: tuple[type, ...], where: str) -> Any:
    """obj[name], whose type must be one of `types` exactly: msgpack makes only exact types,
    and an exact check keeps a bool out of an int field (bool is a subclass of int)."""
    value = obj.get(name, _MISSING)
    if type(value) not in types:
        if value is _MISSING:
            raise CodecError(f"{where}: missing field {name!r}")
        raise CodecError(f"{where}: field {name!r} has type {type(value).__name__}, expected "
                         f"{' or '.join(t.__name__ for t in types)}")
    return value


def _unpack_array(cols: dict[str, Any], name: str, expected: np.dtype) -> np.ndarray:
    """The packed column cols[name], checked against its dtype and byte length."""
    value = _field(cols, name, (list,), "samples")
    if len(value) != 3:
        raise CodecError(f"samples.{name}: expected [dtype, length, bytes]")
    dtype_str, n, data = value
    if dtype_str != expected.str:
        raise CodecError(f"samples.{name}: dtype {dtype_str!r}, expected {expected.str!r}")
    if type(n) is not int or n < 0:
        raise CodecError(f"samples.{name}: bad length {n!r}")
    if type(data) is not bytes:
        raise CodecError(f"samples.{name}: data is {type(data).__name__}, expected bytes")
    if len(data) != n * expected.itemsize:
        raise CodecError(f"samples.{name}: {len(data)} bytes for {n} items of {expected.str} "
                         f"(expected {n * expected.itemsize}): truncated or garbled array")
    return np.frombuffer(data, dtype=expected)


def _first_bad(ok: np.ndarray, starts: list[int]) -> int:
    """The sample whose slice of a column (samples' slices begin at `starts`) holds the first
    item `ok` flags False."""
    return bisect.bisect_right(starts, int(np.argmin(ok))) - 1


def _finite(column: np.ndarray) -> bool:
    """No NaN or infinity in a float32 column: one reduction (a float64 sum of float32 values
    cannot overflow, and any NaN or infinity makes it NaN or infinite)."""
    return math.isfinite(column.sum(dtype=np.float64))


def _allowed_columns(cols: dict[str, Any], tokens: np.ndarray, loss_mask: np.ndarray, starts: list[int]
                     ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The optional allowed_counts and allowed columns, checked: a count on generated tokens only,
    as many ids as the counts add up to, and each masked token among its own allowed ones (else
    the learner's log-prob of it would be -inf). Their token offsets per token (T + 1,), or Nones."""
    if "allowed_counts" not in cols and "allowed" not in cols:
        return None, None, None
    counts = _unpack_array(cols, "allowed_counts", ALLOWED_DTYPE)
    allowed = _unpack_array(cols, "allowed", ALLOWED_DTYPE)
    if len(counts) != len(tokens):
        raise CodecError(f"samples.allowed_counts: {len(counts)} items for {len(tokens)} tokens")
    if len(counts) and (counts.min() < 0 or (counts[loss_mask == 0] > 0).any()):
        ok = (counts >= 0) & ((counts == 0) | (loss_mask == 1))
        raise CodecError(f"samples[{_first_bad(ok, starts)}].allowed_counts: expected 0 or more on generated tokens "
                         "and 0 on context tokens")
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if len(allowed) != offsets[-1]:
        raise CodecError(f"samples.allowed: {len(allowed)} ids, the allowed_counts add up to {offsets[-1]}")
    masked = np.flatnonzero(counts)
    if len(masked):
        hit = np.repeat(tokens[masked], counts[masked]) == allowed
        found = np.add.reduceat(hit, offsets[masked]) > 0
        if not found.all():
            ok = np.ones(len(tokens), bool)
            ok[masked] = found
            i, at = _first_bad(ok, starts), int(masked[np.argmin(found)])
            raise CodecError(f"samples[{i}].allowed: token {int(tokens[at])} at position {at - starts[i]} is not "
                             "among its allowed tokens")
    return counts, allowed, offsets


def decode_group(data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_BYTES) -> RolloutGroup:
    """Decode and validate one rollout group; raise CodecError saying what is wrong."""
    if len(data) > max_bytes:
        raise CodecError(f"payload is {len(data)} bytes, over the limit of {max_bytes} bytes", "oversize")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True,
                              max_bin_len=max_bytes, max_str_len=max_bytes)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise CodecError(f"not a msgpack message: {type(exc).__name__}: {exc}", "undecodable") from None
    if not isinstance(obj, dict):
        raise CodecError(f"message is a {type(obj).__name__}, expected a map", "undecodable")
    kind = obj.get("kind")
    if kind != KIND_ROLLOUT_GROUP:
        raise CodecError(f"kind is {kind!r}, expected {KIND_ROLLOUT_GROUP!r}", "kind")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise CodecError(f"schema_version is {version!r}, this code reads {SCHEMA_VERSION}", "schema_version")

    cols = _field(obj, "samples", (dict,), "group")
    per_sample = {name: _field(cols, name, (list,), "samples") for name in SAMPLE_LISTS}
    count = len(per_sample["lengths"])
    if not count:
        raise CodecError("group: no samples")
    for name, types in SAMPLE_LISTS.items():
        values = per_sample[name]
        if len(values) != count:
            raise CodecError(f"samples.{name}: {len(values)} items for {count} samples")
        if not types.issuperset(map(type, values)):  # exact types, as _field checks them
            i = next(i for i, v in enumerate(values) if type(v) not in types)
            raise CodecError(f"samples[{i}].{name}: has type {type(values[i]).__name__}, expected "
                             f"{' or '.join(t.__name__ for t in SAMPLE_TYPES[name])}")
    lengths, num_turns = per_sample["lengths"], per_sample["num_turns"]
    for name, counts in (("lengths", lengths), ("num_turns", num_turns)):
        if min(counts) < 0:
            raise CodecError(f"samples[{next(i for i, n in enumerate(counts) if n < 0)}].{name}: negative")
    episode_reward: dict[int, float] = {}
    for i, (reward, episode) in enumerate(zip(per_sample["reward"], per_sample["episode"])):
        if not math.isfinite(reward):
            raise CodecError(f"samples[{i}].reward: not finite (NaN or infinite values)")
        if episode < -1:
            raise CodecError(f"samples[{i}].episode: {episode}, expected an index or -1 (an episode of its own)")
        if episode >= 0 and episode_reward.setdefault(episode, reward) != reward:
            raise CodecError(f"samples[{i}].reward: {reward}, but an earlier segment of episode {episode} has "
                             f"{episode_reward[episode]} (an episode's segments share its reward)")
    for i, states in enumerate(per_sample["turn_states"]):
        if states and (len(states) != num_turns[i] or not all(type(k) is str for k in states)):
            raise CodecError(f"samples[{i}].turn_states: expected {num_turns[i]} strings (one per turn) or none")
    for i, refused in enumerate(per_sample["refused_turns"]):
        if not all(type(k) is int for k in refused) or refused != sorted(set(refused)) or \
                (refused and not 0 <= refused[0] <= refused[-1] < num_turns[i]):
            raise CodecError(f"samples[{i}].refused_turns: expected ascending turn indices below {num_turns[i]}")

    starts, turn_starts = [0, *itertools.accumulate(lengths)], [0, *itertools.accumulate(num_turns)]
    columns = {name: _unpack_array(cols, name, dt) for name, dt in TOKEN_ARRAYS.items()}
    sizes = {name: len(c) for name, c in columns.items()}
    if any(n != starts[-1] for n in sizes.values()):
        raise CodecError(f"samples: per-token arrays disagree in length: {sizes}, the samples' lengths add up to "
                         f"{starts[-1]}")
    turn_rewards = _unpack_array(cols, "turn_rewards", np.dtype("<f4"))
    if len(turn_rewards) != turn_starts[-1]:
        raise CodecError(f"samples.turn_rewards: {len(turn_rewards)} values, the samples' num_turns add up to "
                         f"{turn_starts[-1]}")
    tokens, loss_mask, logprobs, versions = (columns[name] for name in TOKEN_ARRAYS)
    # Bad numbers never reach the weights: a NaN or infinite log-prob or reward poisons a step.
    if len(loss_mask) and loss_mask.max() > 1:
        raise CodecError(f"samples[{_first_bad(loss_mask <= 1, starts)}].loss_mask: values must be 0 or 1")
    for name, column, at in (("logprobs", logprobs, starts), ("turn_rewards", turn_rewards, turn_starts)):
        if not _finite(column):
            raise CodecError(f"samples[{_first_bad(np.isfinite(column), at)}].{name}: "
                             "not finite (NaN or infinite values)")

    counts, allowed, allowed_starts = _allowed_columns(cols, tokens, loss_mask, starts)
    samples = [
        Sample(tokens=tokens[a:b], loss_mask=loss_mask[a:b], logprobs=logprobs[a:b], versions=versions[a:b],
               reward=float(reward), turn_rewards=turn_rewards[ta:tb], num_turns=turns, finish_reason=finish,
               task_id=task, env_name=env, success=success, invalid_actions=invalid, turn_states=states,
               refused_turns=refused, timing=timing, episode=episode,
               **({} if counts is None else {"allowed_counts": counts[a:b],
                                             "allowed": allowed[allowed_starts[a]:allowed_starts[b]]}))
        for a, b, ta, tb, turns, reward, success, invalid, finish, task, env, states, refused, timing, episode in zip(
            starts, starts[1:], turn_starts, turn_starts[1:], num_turns, *map(per_sample.get, (
                "reward", "success", "invalid_actions", "finish_reason", "task_id", "env_name", "turn_states",
                "refused_turns", "timing", "episode")))
    ]
    return RolloutGroup(
        group_id=_field(obj, "group_id", (str,), "group"),
        task_id=_field(obj, "task_id", (str,), "group"),
        env_name=_field(obj, "env_name", (str,), "group"),
        actor_id=_field(obj, "actor_id", (str,), "group"),
        created_at=float(_field(obj, "created_at", (int, float), "group")),
        sampling=dict(_field(obj, "sampling", (dict,), "group")),
        samples=samples,
    )
