import pytest

from envs.base import make_env
from envs.builtin import LettersEnv


def test_score_is_fraction_of_matching_characters():
    assert LettersEnv.score("aaa\n", "a") == 1.0
    assert LettersEnv.score("ab", "a") == 0.5
    assert LettersEnv.score("\n", "a") == 0.0
    assert LettersEnv.score("", "a") == 0.0


def test_episode_rewards_sum_to_at_most_one_and_tasks_are_seeded():
    env = make_env("letters", turns=3, alphabet="abcd")
    first = env.reset(42)
    assert first.startswith("Say ") and first[-1] in "abcd"
    total, done, turns = 0.0, False, 0
    while not done:
        target = env.targets[env.turn]
        result = env.step(target * 2 + "\n")
        total, done, turns = total + result.reward, result.done, turns + 1
    assert turns == 3 and total == pytest.approx(1.0)
    again = make_env("letters", turns=3, alphabet="abcd")
    again.reset(42)
    assert again.targets == env.targets
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("a")


def test_unknown_env_and_bad_options_fail_with_the_fix():
    with pytest.raises(ValueError, match="unknown env 'nope'.*letters"):
        make_env("nope")
    with pytest.raises(TypeError):
        make_env("letters", colour="red")
