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
    """A sample's arrays are slices of its group's columns, which are read over the message's bytes."""
    out = decode_group(encode_group(make_group()))
    for name in ("tokens", "loss_mask", "logprobs", "versions", "turn_rewards"):
        column = getattr(out.samples[0], name).base
        assert column is getattr(out.samples[2], name).base and isinstance(column.base, bytes), name


def test_samples_of_any_length_come_back_whole():
    """Samples of no tokens and no turns between others: the column offsets stay aligned."""
    group = make_group()
    empty = make_sample(n_prompt=0, n_gen=0)
    empty.turn_rewards, empty.num_turns, empty.turn_states = np.zeros(0, np.float32), 0, []
    group.samples = [empty, *group.samples, empty, make_sample(n_prompt=300, n_gen=700)]
    group.samples[1].turn_states, group.samples[1].success, group.samples[1].invalid_actions = ["s0"], True, 2
    out = decode_group(encode_group(group))
    assert [len(s.tokens) for s in out.samples] == [0, 8, 8, 8, 0, 1000]
    for a, b in zip(group.samples, out.samples):
        for name in ("tokens", "loss_mask", "logprobs", "versions", "turn_rewards"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (b.num_turns, b.turn_states, b.success, b.invalid_actions) == \
            (a.num_turns, a.turn_states, a.success, a.invalid_actions)


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


def _set(column: str, index, value):
    return lambda o: o["samples"][column].__setitem__(index, value)


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.update(kind="weights"), "kind is 'weights'"),
    (lambda o: o.update(schema_version=99), "schema_version is 99"),
    (lambda o: _set("tokens", 2, o["samples"]["tokens"][2][:-4])(o), "samples.tokens: 92 bytes for 24 items"),
    (_set("logprobs", 0, "<f8"), "samples.logprobs: dtype '<f8'"),
    (lambda o: o["samples"].pop("reward"), "samples: missing field 'reward'"),
    (_set("num_turns", 0, 3), "samples.turn_rewards: 3 values, the samples' num_turns add up to 5"),
    (_set("lengths", 1, -8), "samples\\[1\\].lengths: negative"),
    (_set("lengths", 1, 9), "per-token arrays disagree in length: .* the samples' lengths add up to 25"),
    (lambda o: o["samples"].update(lengths=[]), "no samples"),
    (lambda o: o.update(samples=[]), "field 'samples' has type list"),
    (lambda o: o["samples"]["finish_reason"].pop(), "samples.finish_reason: 2 items for 3 samples"),
    (_set("success", 2, 1), "samples\\[2\\].success: has type int, expected bool"),
    (_set("reward", 1, "0.5"), "samples\\[1\\].reward: has type str"),
    (_set("turn_states", 2, ["a", "b"]), "samples\\[2\\].turn_states: expected 1 strings"),
    (_set("refused_turns", 1, [1]), "samples\\[1\\].refused_turns: expected ascending turn indices below 1"),
    (_set("refused_turns", 0, [0, 0]), "samples\\[0\\].refused_turns: expected ascending"),
    (lambda o: o.update(group_id=5), "field 'group_id' has type int"),
])
def test_invalid_messages_say_what_is_wrong(mutate, message):
    with pytest.raises(CodecError, match=message):
        decode_group(_tamper(mutate))


def test_per_token_arrays_must_agree():
    def shorten_mask(o):
        o["samples"]["loss_mask"] = ["|u1", 23, o["samples"]["loss_mask"][2][:23]]
    with pytest.raises(CodecError, match="disagree in length"):
        decode_group(_tamper(shorten_mask))
    group = make_group()
    group.samples[1].versions = group.samples[1].versions[:-1]
    with pytest.raises(CodecError, match="samples\\[1\\]: per-token arrays disagree in length"):
        encode_group(group)  # refused on the actor's side, naming the sample


@pytest.mark.parametrize("spoil, message", [
    (lambda s: setattr(s, "num_turns", 2), "samples\\[1\\]: num_turns=2 but 1 turn rewards"),
    (lambda s: setattr(s, "logprobs", np.float32(0.5)), "samples\\[1\\]: .* has no len\\(\\): arrays must be 1-D"),
    (lambda s: setattr(s, "tokens", s.tokens.reshape(-1, 1)), "samples' tokens: all the input arrays must have same number"),
])
def test_the_encoder_refuses_a_sample_the_columns_could_not_place(spoil, message):
    """Mismatches the columns would hide (a turn reward counted in the next sample) or turn into
    another error are refused on the actor's side, naming the sample."""
    group = make_group()
    spoil(group.samples[1])
    with pytest.raises(CodecError, match=message):
        encode_group(group)


def test_a_bad_mask_value_names_its_sample():
    group = make_group()
    group.samples[2].loss_mask = group.samples[2].loss_mask.copy()
    group.samples[2].loss_mask[4] = 2
    with pytest.raises(CodecError, match="samples\\[2\\].loss_mask: values must be 0 or 1"):
        decode_group(encode_group(group))


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


def masked_group() -> RolloutGroup:
    """Samples 0 and 2 with their generated tokens masked (actor.constrain_actions), sample 1 not."""
    group = make_group()
    for s in group.samples[::2]:  # tokens 5, 6, 7 generated
        s.allowed_counts = np.array([0] * 5 + [2, 1, 3], np.int32)
        s.allowed = np.array([5, 9, 6, 1, 7, 2], np.int32)
    return group


def test_allowed_tokens_travel_with_their_samples():
    out = decode_group(encode_group(masked_group()))
    for k in (0, 2):
        np.testing.assert_array_equal(out.samples[k].allowed_counts, [0] * 5 + [2, 1, 3])
        np.testing.assert_array_equal(out.samples[k].allowed, [5, 9, 6, 1, 7, 2])
    assert not out.samples[1].allowed_counts.any() and len(out.samples[1].allowed) == 0
    plain = decode_group(encode_group(make_group()))  # nothing masked: no columns, None
    assert all(s.allowed is None and s.allowed_counts is None for s in plain.samples)


@pytest.mark.parametrize("spoil, message", [
    (lambda s: s.allowed_counts.__setitem__(2, 1), r"samples\[0\].allowed_counts: expected 0 or more on generated"),
    (lambda s: s.allowed.__setitem__(0, 4), r"samples\[0\].allowed: token 5 at position 5 is not among"),
    (lambda s: s.allowed.__setitem__(4, 3), r"samples\[0\].allowed: token 7 at position 7 is not among"),
])
def test_a_bad_allowed_set_names_its_sample(spoil, message):
    group = masked_group()
    spoil(group.samples[0])
    if "counts" in message:  # a count more: one id more, so the lengths still agree
        group.samples[0].allowed = np.concatenate([[2], group.samples[0].allowed]).astype(np.int32)
    with pytest.raises(CodecError, match=message):
        decode_group(encode_group(group))


def test_allowed_ids_must_add_up_to_their_counts():
    group = masked_group()
    group.samples[2].allowed = group.samples[2].allowed[:-1]
    with pytest.raises(CodecError, match="samples.allowed: 11 ids, the allowed_counts add up to 12"):
        decode_group(encode_group(group))
    group.samples[2].allowed = None
    with pytest.raises(CodecError, match=r"samples\[2\]: allowed_counts and allowed go together"):
        encode_group(group)
