"""actor.constrain_actions' rule (actors/choices.py): which tokens may follow a turn's prefix."""

import pytest

from actors.choices import ChoiceTrie, continued


def test_the_trie_allows_what_continues_a_choice_and_nothing_once_one_is_left_or_done():
    trie = ChoiceTrie([[1, 2, 9], [1, 3, 9], [4, 9], [1, 2, 5, 9]])
    assert trie.allowed([]) == [1, 4]
    assert sorted(trie.allowed([1])) == [2, 3]
    assert sorted(trie.allowed([1, 2])) == [5, 9]  # a choice may be the start of another
    assert trie.allowed([1, 2, 9]) is None  # complete: the turn has ended
    assert trie.allowed([7]) is None  # off every choice (never sampled under the mask)
    with pytest.raises(ValueError, match="non-empty"):
        ChoiceTrie([])
    with pytest.raises(ValueError, match="non-empty"):
        ChoiceTrie([[1], []])


def test_a_continued_turn_keeps_the_rest_of_the_choices_it_began():
    choices = [[1, 2, 9], [1, 3, 9], [4, 9]]
    assert continued(choices, []) == choices
    assert continued(choices, [1]) == [[2, 9], [3, 9]]
    assert continued(choices, [1, 2, 9]) == []  # done: nothing to continue


def test_along_a_turn_each_token_has_what_the_mask_let_through_and_nothing_past_the_choices():
    trie = ChoiceTrie([[1, 2, 9], [1, 3, 9], [4, 9], [1, 2, 5, 9]])
    along = trie.along([1, 2, 5, 9])
    assert [sorted(a) for a in along] == [[1, 4], [2, 3], [5, 9], [9]]
    assert along == [trie.allowed([1, 2, 5, 9][:k]) for k in range(4)]  # the engine's rule, token by token
    assert trie.along([4, 9, 7]) == [[1, 4], [9], []]  # a choice complete: the engine masks nothing after it
    assert trie.along([7, 1]) == [[1, 4], []]
