"""actor.constrain_actions' rule (actors/choices.py): which tokens may follow a turn's prefix."""

import random

import pytest

from actors.choices import Choices

SEQUENCES = [[1, 2, 9], [1, 3, 9], [4, 9], [1, 2, 5, 9]]


def test_the_choices_allow_what_continues_one_and_nothing_once_one_is_left_or_done():
    choices = Choices.of(SEQUENCES)
    assert choices.allowed([]) == [1, 4]
    assert choices.allowed([1]) == [2, 3]
    assert choices.allowed([1, 2]) == [5, 9]  # a choice may be the start of another
    assert choices.allowed([1, 2, 9]) is None  # complete: the turn has ended
    assert choices.allowed([1, 2, 5, 9]) is None  # the longest complete
    assert choices.allowed([7]) is None  # off every choice (never sampled under the mask)
    assert choices.allowed([1, 2, 5, 9, 9]) is None  # past the longest
    with pytest.raises(ValueError, match="non-empty"):
        Choices.of([])
    with pytest.raises(ValueError, match="non-empty"):
        Choices.of([[1], []])


def test_a_request_s_bytes_are_the_same_choices():
    choices = Choices.of(SEQUENCES)
    again = Choices.from_bytes(choices.to_bytes())
    assert again.sequences() == SEQUENCES and len(again) == 4
    assert again.allowed([1]) == [2, 3]


def test_the_engine_s_cursor_narrowed_token_by_token_agrees_with_the_rule_from_scratch():
    """The per-request state the logits processor keeps, fed each step's growing output, against
    `allowed` of each prefix; a prefix that does not extend the last starts over."""
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(1, 7))] for _ in range(40)]
    choices = Choices.of(sequences)
    for _ in range(50):
        walk = list(rng.choice(sequences)) + [rng.randrange(6) for _ in range(rng.randrange(3))]
        cursor = choices.cursor()
        for k in range(len(walk) + 1):
            got = cursor.allowed(walk[:k])
            want = sorted({s[k] for s in sequences if len(s) > k and s[:k] == walk[:k]}) or None
            assert (None if got is None else got.tolist()) == want, (walk, k)
    cursor = choices.cursor()
    cursor.allowed(sequences[0][:2])
    assert cursor.allowed([]).tolist() == choices.allowed([])  # started over


def test_a_continued_turn_keeps_the_rest_of_the_choices_it_began():
    choices = Choices.of([[1, 2, 9], [1, 3, 9], [4, 9]])
    assert choices.continued([]) is choices
    assert choices.continued([1]).sequences() == [[2, 9], [3, 9]]
    assert choices.continued([1, 2]).sequences() == [[9]]
    assert choices.continued([1, 2, 9]) is None  # done: nothing to continue
    assert choices.continued([7]) is None


def test_along_a_turn_each_token_has_what_the_mask_let_through_and_nothing_past_the_choices():
    choices = Choices.of(SEQUENCES)
    along = choices.along([1, 2, 5, 9])
    assert along == [[1, 4], [2, 3], [5, 9], [9]]
    assert along == [choices.allowed([1, 2, 5, 9][:k]) for k in range(4)]  # the engine's rule, token by token
    assert choices.along([4, 9, 7]) == [[1, 4], [9], []]  # a choice complete: the engine masks nothing after it
    assert choices.along([7, 1]) == [[1, 4], []]
