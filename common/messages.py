"""The rollout-group message and its msgpack codec.

One wire format, msgpack, never pickle. Arrays travel as ``[dtype, length, bytes]`` with
little-endian raw bytes and are decoded with ``np.frombuffer`` (no copy beyond msgpack's
own). Every message carries ``kind`` and ``schema_version``; decoding checks both, checks
every array's byte length against its declared length, checks that the per-token arrays
of a sample agree, and refuses payloads over a size limit before unpacking them.

This module imports neither torch nor vLLM so every process can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

import msgpack
import numpy as np

KIND_ROLLOUT_GROUP = "rollout_group"
SCHEMA_VERSION = 3  # 2: samples carry success and invalid_actions; 3: turn_states
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

# Per-token arrays of a sample, with the dtype they travel as.
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
}
ALLOWED_DTYPES = {dt.str for dt in TOKEN_ARRAYS.values()} | {np.dtype("<f4").str}


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
    timing: dict[str, float] = dataclasses.field(default_factory=dict)

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
        return np.array([s.reward for s in self.samples], dtype=np.float32)

    def oldest_version(self) -> int:
        """The oldest weight version that produced any token of the group (-1 if none)."""
        versions = [v for v in (s.oldest_version() for s in self.samples) if v >= 0]
        return min(versions) if versions else -1


# --- encoding ---------------------------------------------------------------------------


def _pack_array(array: np.ndarray, dtype: np.dtype) -> list[Any]:
    array = np.ascontiguousarray(array, dtype=dtype)
    if array.ndim != 1:
        raise CodecError(f"arrays must be 1-D, got shape {array.shape}")
    return [dtype.str, int(array.shape[0]), array.tobytes()]


def _sample_to_dict(sample: Sample) -> dict[str, Any]:
    out: dict[str, Any] = {name: _pack_array(getattr(sample, name), dt) for name, dt in TOKEN_ARRAYS.items()}
    out["turn_rewards"] = _pack_array(sample.turn_rewards, np.dtype("<f4"))
    out.update(
        reward=float(sample.reward),
        num_turns=int(sample.num_turns),
        finish_reason=sample.finish_reason,
        task_id=sample.task_id,
        env_name=sample.env_name,
        success=bool(sample.success),
        invalid_actions=int(sample.invalid_actions),
        turn_states=[str(k) for k in sample.turn_states],
        timing={k: float(v) for k, v in sample.timing.items()},
    )
    return out


def encode_group(group: RolloutGroup, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    payload = {
        "kind": KIND_ROLLOUT_GROUP,
        "schema_version": SCHEMA_VERSION,
        "group_id": group.group_id,
        "task_id": group.task_id,
        "env_name": group.env_name,
        "actor_id": group.actor_id,
        "created_at": float(group.created_at),
        "sampling": group.sampling,
        "samples": [_sample_to_dict(s) for s in group.samples],
    }
    data = msgpack.packb(payload, use_bin_type=True)
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


def _unpack_array(value: Any, expected: np.dtype, where: str) -> np.ndarray:
    if not (isinstance(value, (list, tuple)) and len(value) == 3):
        raise CodecError(f"{where}: expected [dtype, length, bytes]")
    dtype_str, length, data = value
    if dtype_str != expected.str:
        raise CodecError(f"{where}: dtype {dtype_str!r}, expected {expected.str!r}")
    if not isinstance(length, int) or length < 0:
        raise CodecError(f"{where}: bad length {length!r}")
    if not isinstance(data, bytes):
        raise CodecError(f"{where}: data is {type(data).__name__}, expected bytes")
    if len(data) != length * expected.itemsize:
        raise CodecError(
            f"{where}: {len(data)} bytes for {length} items of {expected.str} "
            f"(expected {length * expected.itemsize}): truncated or garbled array"
        )
    return np.frombuffer(data, dtype=expected)


def _decode_sample(obj: Any, where: str) -> Sample:
    if not isinstance(obj, dict):
        raise CodecError(f"{where}: expected a map")
    arrays = {name: _unpack_array(_field(obj, name, (list, tuple), where), dt, f"{where}.{name}")
              for name, dt in TOKEN_ARRAYS.items()}
    if len({a.shape[0] for a in arrays.values()}) != 1:
        lengths = {name: a.shape[0] for name, a in arrays.items()}
        raise CodecError(f"{where}: per-token arrays disagree in length: {lengths}")
    if arrays["loss_mask"].size and arrays["loss_mask"].max() > 1:
        raise CodecError(f"{where}.loss_mask: values must be 0 or 1")
    turn_rewards = _unpack_array(_field(obj, "turn_rewards", (list, tuple), where), np.dtype("<f4"),
                                 f"{where}.turn_rewards")
    num_turns = _field(obj, "num_turns", (int,), where)
    if num_turns != turn_rewards.shape[0]:
        raise CodecError(f"{where}: num_turns={num_turns} but {turn_rewards.shape[0]} turn rewards")
    reward = float(_field(obj, "reward", (int, float), where))
    turn_states = _field(obj, "turn_states", (list,), where)
    if turn_states and (len(turn_states) != num_turns or not all(type(k) is str for k in turn_states)):
        raise CodecError(f"{where}.turn_states: expected {num_turns} strings (one per turn) or none")
    # Bad numbers never reach the weights: a NaN or infinite log-prob or reward poisons a step.
    for name, finite in (("logprobs", np.isfinite(arrays["logprobs"]).all()),
                         ("turn_rewards", np.isfinite(turn_rewards).all()), ("reward", math.isfinite(reward))):
        if not finite:
            raise CodecError(f"{where}.{name}: not finite (NaN or infinite values)")
    return Sample(
        **arrays,
        reward=reward,
        turn_rewards=turn_rewards,
        num_turns=num_turns,
        finish_reason=_field(obj, "finish_reason", (str,), where),
        task_id=_field(obj, "task_id", (str,), where),
        env_name=_field(obj, "env_name", (str,), where),
        success=_field(obj, "success", (bool,), where),
        invalid_actions=_field(obj, "invalid_actions", (int,), where),
        turn_states=turn_states,
        timing=dict(_field(obj, "timing", (dict,), where)),
    )


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
    samples = _field(obj, "samples", (list,), "group")
    if not samples:
        raise CodecError("group: no samples")
    return RolloutGroup(
        group_id=_field(obj, "group_id", (str,), "group"),
        task_id=_field(obj, "task_id", (str,), "group"),
        env_name=_field(obj, "env_name", (str,), "group"),
        actor_id=_field(obj, "actor_id", (str,), "group"),
        created_at=float(_field(obj, "created_at", (int, float), "group")),
        sampling=dict(_field(obj, "sampling", (dict,), "group")),
        samples=[_decode_sample(s, f"samples[{i}]") for i, s in enumerate(samples)],
    )
