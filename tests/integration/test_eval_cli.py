"""`omrl eval` against known policies, end to end through the CLI: our env server in the
process, real HTTP, the held-out tasks only, a table and JSON with 95% intervals."""

import json
import subprocess
import sys


def omrl_eval(*args: str, quiet: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *(["--quiet"] if quiet else []), "eval", *args],
                          capture_output=True, text=True, timeout=120)


def test_oracle_and_random_policies_give_the_known_figures(tmp_path):
    out = tmp_path / "eval.json"
    done = omrl_eval("--env", "letters", "--policy", "oracle", "--episodes", "100", "--out", str(out))
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.strip().splitlines()[-2:]
    assert header.split()[:3] == ["env", "policy", "episodes"]
    assert row.split()[:4] == ["letters", "oracle", "100", "1.000"]
    [oracle] = json.loads(out.read_text())
    assert oracle["success"] == 1.0 and oracle["reward"] == 1.0 and oracle["success_ci"][0] > 0.96
    # Progress (stderr is no terminal here: a line at every tenth, with the time left).
    lines = [line for line in done.stderr.splitlines() if line.startswith("oracle on letters: ")]
    assert [line.split()[3] for line in lines] == [f"{n}/100" for n in range(10, 101, 10)], done.stderr
    assert "s left" in lines[0] and "s left" not in lines[-1]

    # letters (2 turns, alphabet abcd): a uniformly random letter earns 1/4 a turn: mean 0.25,
    # and solves a task (both turns) with probability 1/16.
    done = omrl_eval("--env", "letters", "--policy", "random", "--episodes", "100", "--json", quiet=True)
    assert done.returncode == 0, done.stderr
    assert "random on letters" not in done.stderr  # omrl --quiet: no progress
    [random] = json.loads(done.stdout)
    assert random["episodes"] == 100 and random["invalid_action_frac"] == 0.0
    sd = (0.25 * 0.75 / 2 / 100) ** 0.5  # per turn Bernoulli(1/4), two turns an episode, 100 episodes
    assert abs(random["reward"] - 0.25) < 4 * sd
    assert random["reward_ci"][0] < random["reward"] < random["reward_ci"][1]
    assert abs(random["success"] - 1 / 16) < 4 * (1 / 16 * 15 / 16 / 100) ** 0.5
    assert random["success_ci"][0] <= random["success"] <= random["success_ci"][1]


def test_bad_arguments_are_refused_in_one_line():
    done = omrl_eval("--env", "letters", "--policy", "model")
    assert done.returncode != 0 and "needs --model PATH" in done.stderr
    done = omrl_eval("--env", "letters", "--env", "babyai", "--env-url", "http://127.0.0.1:1")
    assert done.returncode != 0 and "--env-url names one server" in done.stderr
    # An env server that is not there: one line naming it, no traceback.
    done = omrl_eval("--env", "letters", "--policy", "oracle", "--env-url", "http://127.0.0.1:9", "--episodes", "2")
    assert done.returncode == 1 and "error: " in done.stderr and "127.0.0.1:9" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
