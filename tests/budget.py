"""The suite's time budget, kept in view: at the end of every run, the wall time against the
budget, the ten slowest tests (set-up, call and teardown together), the fixtures whose
set-up cost the most, and the tests whose `slow` mark disagrees with what they took. As the
run goes, a line for each failure and each test over a minute, with the minute it ended.

It reports and never fails a test: speed belongs in benchmarks, not assertions. It works
under pytest-xdist: fixture set-up times travel to the controller in each report's
`user_properties`."""

from __future__ import annotations

import collections
import os
import time

import pytest

BUDGET_MIN = 40  # minutes of pytest on the 2-core reference machine (README, "Tests")
SLOW_S = 60  # a test that takes longer is marked slow; one marked slow takes longer
FIXTURE_KEY = "fixture_setup_s"

# The test files that take longest, longest first, as measured on a cold 2-core machine
# (README, "Tests"). pytest-xdist hands whole files to its two workers in this order
# (--dist loadfile --no-loadscope-reorder), so the long ones start first and the short ones
# fill in around them; the rest follow in their usual order. A new file of more than a
# minute belongs here, where its measured time puts it.
LONGEST_FIRST = [
    "tests/e2e/test_suite_learns.py",
    "tests/e2e/test_compose.py",
    "tests/e2e/test_demo.py",
    "tests/e2e/test_omrl_run.py",
    "tests/integration/test_bench.py",
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_partitions.py",
    "tests/e2e/test_agent_learns.py",
    "tests/integration/test_real_env_runs.py",
    "tests/integration/test_plugins.py",
    "tests/integration/test_env_sciworld.py",
    "tests/integration/test_learner_faults.py",
    "tests/integration/test_broadcast.py",
]

# How many times what a test takes alone on the idle reference machine it may take before a
# timeout calls it hung: the two workers share the 2 cores (each test takes about 2.2 times
# as long), and CI's machines have been up to about 2 times slower than the reference (the
# Ctrl-C test alone: 74, 142 and 90 s in three sessions; the BabyAI demo took 5.1 times its
# time alone in CI). OMRL_TEST_SLACK changes it for a slower or a faster machine.
SLACK = float(os.environ.get("OMRL_TEST_SLACK", 8))


def patience(alone_s: float) -> float:
    """The timeout for something that takes `alone_s` seconds alone on the idle reference
    machine (docs/results/time-budget.md): a hang still fails, a slow machine does not."""
    return alone_s * SLACK


_pending: list[tuple[str, str, float]] = []  # this process's fixture set-ups since the last report


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds >= 0.05:
        _pending.append((fixturedef.argname, fixturedef.scope, seconds))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "setup" and _pending:
        outcome.get_result().user_properties.append((FIXTURE_KEY, list(_pending)))
        _pending.clear()


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


class Budget:
    def __init__(self, config):
        self.config = config
        self.start = time.monotonic()
        self.tests: dict[str, float] = collections.defaultdict(float)  # nodeid -> seconds, all phases
        self.slow_marked: dict[str, bool] = {}
        self.fixtures: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        self.tests[report.nodeid] += report.duration
        self.say_now(report)
        if report.when == "call":  # tests skipped before their call are left out of the mark check
            self.slow_marked[report.nodeid] = "slow" in report.keywords
        for key, value in report.user_properties:
            if key == FIXTURE_KEY:
                for name, scope, seconds in value:
                    self.fixtures[(name, scope)].append(seconds)

    def say_now(self, report) -> None:
        """A line as it happens for a failure and for a test over `SLOW_S`: when CI stops a
        run at its time limit it keeps only the output's tail, where pytest's summary of the
        failures would have come last."""
        seconds = self.tests[report.nodeid]
        failed = report.failed
        if not failed and not (report.when == "teardown" and seconds > SLOW_S):
            return
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is None:
            return
        minute = (time.monotonic() - self.start) / 60
        if failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            why = crash.message.splitlines()[0][:200] if crash and crash.message else str(report.longrepr)[-200:]
            terminal.write_line(f"\n[{minute:5.1f} min] FAILED in {report.when}: {report.nodeid} ({seconds:.0f} s): {why}")
        else:
            terminal.write_line(f"\n[{minute:5.1f} min] done: {report.nodeid} ({seconds:.0f} s)")

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if not self.tests:
            return
        write = terminalreporter.write_line
        wall = time.monotonic() - self.start
        total = sum(self.tests.values())
        terminalreporter.section("time budget")
        over = "  OVER BUDGET" if wall > BUDGET_MIN * 60 else ""
        write(f"wall time {wall / 60:.1f} min of a {BUDGET_MIN}-minute budget{over}; "
              f"the tests' own time adds up to {total / 60:.1f} min")
        write("ten slowest tests (set-up + call + teardown):")
        for nodeid, seconds in sorted(self.tests.items(), key=lambda kv: -kv[1])[:10]:
            write(f"  {seconds:7.1f} s  {100 * seconds / total:4.1f}%  {nodeid}")
        if self.fixtures:
            write("fixture set-ups that cost the most (total over the run, times set up):")
            ranked = sorted(self.fixtures.items(), key=lambda kv: -sum(kv[1]))[:10]
            for (name, scope), times in ranked:
                write(f"  {sum(times):7.1f} s  {100 * sum(times) / total:4.1f}%  {name} ({scope}, x{len(times)})")
        unmarked = [n for n, s in self.tests.items() if s > SLOW_S and not self.slow_marked.get(n, True)]
        quick = [n for n, s in self.tests.items() if s < SLOW_S / 2 and self.slow_marked.get(n)]
        for nodeid in sorted(unmarked):
            write(f"  over {SLOW_S} s and not marked slow: {nodeid} ({self.tests[nodeid]:.0f} s)")
        for nodeid in sorted(quick):
            write(f"  marked slow, took {self.tests[nodeid]:.0f} s: {nodeid}")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) reports
        config.pluginmanager.register(Budget(config), "omrl-budget")
