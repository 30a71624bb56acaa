import msgpack
import numpy as np
import pytest

from common.messages import CodecError, RolloutGroup, Sample, decode_group, encode_group


def make_sample(n_prompt=5, n_gen=3, reward=0.5, version=2) -> Sample:
    n = n_prompt + n_gen
    return Sample(
        tokens=np.arange(n, dtype=np.int32),
        loss_mask=np.array([0] * n_prompt + [1] * n_gen, np.uint8),
        logprobs=np.array([0.0] * n_prompt + [-0.5] * n_gen, np.float32),
        versions=np.array([-1] * n_prompt + [version] * n_gen, np.int32),
        reward=reward, turn_rewards=np.array([reward], np.float32), num_turns=1,
        finish_reason="done", task_id="7", env_name="letters", timing={"total_s": 0.1},
    )


def make_group(**kw) -> RolloutGroup:
    return RolloutGroup(task_id="7", env_name="letters", actor_id="a0", sampling={"temperature": 1.0},
                        samples=[make_sample(reward=r, **kw) for r in (0.0, 0.5, 1.0)])


def test_round_trip_keeps_every_field():
    group = make_group()
    out = decode_group(encode_group(group))
    assert out.group_id == group.group_id and out.task_id == "7" and out.actor_id == "a0"
    assert out.sampling == {"temperature": 1.0}
    assert out.created_at == pytest.approx(group.created_at)
    for a, b in zip(group.samples, out.samples):
        for name in ("tokens", "loss_mask", "logprobs", "versions", "turn_rewards"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(b, name).dtype == getattr(a, name).dtype
        assert (b.reward, b.num_turns, b.finish_reason, b.timing) == (a.reward, a.num_turns, a.finish_reason, a.timing)
    np.testing.assert_array_equal(out.rewards, [0.0, 0.5, 1.0])
    assert out.oldest_version() == 2


def test_arrays_are_views_over_the_message_bytes():
    out = decode_group(encode_group(make_group()))
    tokens = out.samples[0].tokens
    assert not tokens.flags.owndata and isinstance(tokens.base, bytes)


def test_truncated_message_is_refused():
    data = encode_group(make_group())
    with pytest.raises(CodecError, match="not a msgpack message"):
        decode_group(data[: len(data) // 2])


def test_garbage_is_refused():
    with pytest.raises(CodecError):
        decode_group(b"\xc1\xff\x00garbage")
    with pytest.raises(CodecError, match="expected a map"):
        decode_group(msgpack.packb([1, 2, 3]))


def test_oversize_payload_is_refused_on_both_sides():
    data = encode_group(make_group())
    with pytest.raises(CodecError, match="over the limit"):
        decode_group(data, max_bytes=len(data) - 1)
    with pytest.raises(CodecError, match="over the limit"):
        encode_group(make_group(), max_bytes=100)


def _tamper(mutate) -> bytes:
    obj = msgpack.unpackb(encode_group(make_group()), raw=False)
    mutate(obj)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.update(kind="weights"), "kind is 'weights'"),
    (lambda o: o.update(schema_version=99), "schema_version is 99"),
    (lambda o: o["samples"][1]["tokens"].__setitem__(2, o["samples"][1]["tokens"][2][:-4]), "samples\\[1\\].tokens: 28 bytes for 8 items"),
    (lambda o: o["samples"][0]["logprobs"].__setitem__(0, "<f8"), "dtype '<f8'"),
    (lambda o: o["samples"][0].pop("reward"), "missing field 'reward'"),
    (lambda o: o["samples"][0].update(num_turns=3), "num_turns=3 but 1 turn rewards"),
    (lambda o: o.update(samples=[]), "no samples"),
    (lambda o: o.update(group_id=5), "field 'group_id' has type int"),
])
def test_invalid_messages_say_what_is_wrong(mutate, message):
    with pytest.raises(CodecError, match=message):
        decode_group(_tamper(mutate))


def test_per_token_arrays_must_agree():
    def shorten_mask(o):
        s = o["samples"][0]
        s["loss_mask"] = ["|u1", 7, s["loss_mask"][2][:7]]
    with pytest.raises(CodecError, match="disagree in length"):
        decode_group(_tamper(shorten_mask))


@pytest.mark.parametrize("field, value", [("logprobs", np.nan), ("logprobs", -np.inf), ("reward", np.nan),
                                          ("turn_rewards", np.inf)])
def test_non_finite_numbers_are_invalid(field, value):
    group = make_group()
    sample = group.samples[1]
    if field == "reward":
        sample.reward = value
    else:
        getattr(sample, field)[-1] = value
    with pytest.raises(CodecError, match=f"samples\\[1\\].{field}: not finite") as exc:
        decode_group(encode_group(group))
    assert exc.value.reason == "invalid"
