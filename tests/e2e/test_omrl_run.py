"""The whole system through `omrl run`: real processes, the embedded Redis, the env server,
two vLLM actors on CPU and the learner, on the default tiny model."""

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import Config
from common.metrics import read_jsonl
from deploy.supervisor import STOP_TIMEOUT_S
from tests.budget import patience
from tests.e2e.learning import fifths
from tests.procs import cmdline, processes_mentioning

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]


def omrl(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> SimpleNamespace:
    """The default run, its evaluator (on by default: learner.eval_tasks held-out tasks every
    learner.eval_every versions) SIGKILLed once after its first evaluation, with weights going by
    broadcast (one gloo group of the learner, both actors and the evaluator, staged by each), its
    plot redrawn every 10 s while it runs (the default is 300). Shared by this module's tests."""
    tmp_path = tmp_path_factory.mktemp("default-run")
    run_dir = tmp_path / "run"
    started = time.monotonic()
    with open(tmp_path / "out.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir),
                                 "--set", 'weights.transport="broadcast"', "--set", "run.plot_every_s=10"],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        live_plots = set()  # the modification times of metrics.png seen while the run went on
        evaluator_killed_at = None  # the step
        while proc.poll() is None and time.monotonic() - started < patience(150):
            time.sleep(1)
            if (run_dir / "metrics.png").exists() and proc.poll() is None:
                live_plots.add((run_dir / "metrics.png").stat().st_mtime)
            evaluator_log = run_dir / "logs" / "evaluator.log"
            evaluated = evaluator_log.exists() and re.search(r"evaluation at version \d+ on", evaluator_log.read_text())
            if evaluator_killed_at is None and evaluated:
                # As soon as its first evaluation is out: a restarted vLLM engine takes minutes on 2 busy cores.
                steps = sum(1 for _ in open(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
                pids = set(processes_mentioning("--evaluator")) & set(processes_mentioning(str(run_dir)))
                assert len(pids) == 1, pids
                os.kill(pids.pop(), signal.SIGKILL)
                evaluator_killed_at = steps
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        log.seek(0)
        out = log.read()
    return SimpleNamespace(tmp_path=tmp_path, run_dir=run_dir, out=out, returncode=proc.returncode,
                           elapsed=time.monotonic() - started, live_plots=live_plots,
                           evaluator_killed_at=evaluator_killed_at)


@pytest.mark.timeout(patience(160))
def test_default_run_learns_and_actors_apply_new_weights(default_run):
    run_dir, tmp_path, out, elapsed = default_run.run_dir, default_run.tmp_path, default_run.out, default_run.elapsed
    live_plots = default_run.live_plots
    print(out[-4000:])
    print(f"omrl run took {elapsed:.0f}s")
    assert default_run.returncode == 0, out[-4000:]

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 20
    for key in ("step", "reward/mean", "weight_version", "staleness/mean", "perf/tokens_per_s"):
        assert all(key in r for r in rows), key
    rewards = [r["reward/mean"] for r in rows]
    reward = fifths(rows, "reward/mean")
    print(f"reward {reward}")
    assert reward.gain >= 0.3, rewards
    assert reward.p < 0.001, rewards  # no order of the same steps' rewards but a learning one does as well

    # Tokens the actors generated carry the weight version they ran on: actors applied new versions.
    versions_used = {v for r in rows for v in (r["batch/version_min"], r["batch/version_max"])}
    assert len({v for v in versions_used if v >= 1}) >= 2, versions_used
    for log in sorted((run_dir / "logs").glob("actor*.log")):
        assert log.read_text().count("by broadcast") >= 2, log
    # Both actors and the evaluator joined (the evaluator again after its restart; its first
    # process may be killed before it needs a version beyond the first).
    assert (run_dir / "logs" / "learner.log").read_text().count("joined the weight group") in (3, 4)
    # One group for all: a version leaves the learner once (again only for a joiner; one published
    # while a send is under way may be skipped for the newer), and each send reaches every member.
    last = rows[-1]
    assert last["weights/members"] == 3 and last["weights/sends"] <= last["weight_version"] + 6, last
    assert last["weights/sent"] >= 2 * last["weights/sends"] - 4, last
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert len(live_plots) >= 2, "metrics.png was not redrawn while the run went on"
    # Every number of every record reached TensorBoard (the default sinks), and every key is documented.
    from tests.metrics_doc import undocumented
    from tests.unit.test_metrics_sinks import tensorboard_scalars

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _v in scalars["reward/mean"]] == [r["step"] for r in rows]
    assert [v for _s, v in scalars["reward/mean"]] == pytest.approx(rewards, rel=1e-6)
    assert {"eval/success", "weights/sends", "learner/grad_norm"} <= set(scalars)
    assert undocumented(k for r in rows for k in r) == []
    # Every 10th step kept 4 episodes (the best, the worst, two at random), turn by turn, also as text.
    from learner.samples import read_samples
    from tests.unit.test_metrics_sinks import tensorboard_text

    kept = read_samples(run_dir)
    kept_steps = sorted({k["step"] for k in kept})
    assert kept_steps == [s for s in range(10, len(rows) + 1, 10)], kept_steps
    for step in kept_steps:
        episodes = [k for k in kept if k["step"] == step]
        assert [k["why"] for k in episodes] == ["best", "worst", "random", "random"]
        assert episodes[0]["reward"] == max(episodes[0]["group_rewards"] + [k["reward"] for k in episodes])
        assert all(t["text"] for k in episodes for t in k["turns"])
        assert {t["role"] for k in episodes for t in k["turns"]} == {"prompt", "model", "observation"}
    assert [s for s, _text in tensorboard_text(run_dir / "tensorboard", "samples/best")] == kept_steps
    # The evaluator's evaluations, each on one version, reached the learner's step records: its
    # first, at the first version it found (0 where its engine was up before the learner's first
    # step, a few later on a busy machine: the run never waits for it); SIGKILLed just after it, it
    # was restarted, evaluated the version it found and went on. The actors evaluate nothing.
    evals = [r for r in rows if "eval/reward" in r]
    versions = [r["eval/version"] for r in evals]
    every = Config().learner.eval_every
    assert len(evals) >= 2 and versions[0] < versions[1] and versions == sorted(versions), versions
    assert len({v // every for v in versions}) == len(versions), versions  # one evaluation a slot, restart or not
    assert all(r["eval/last_version"] == r["eval/version"] for r in evals)
    assert default_run.evaluator_killed_at is not None and "evaluator was killed by SIGKILL; restart 1" in out
    assert all(r["eval/episodes"] == Config().learner.eval_tasks and 0 <= r["eval/success"] <= 1 for r in evals)
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"]  # greedy on held-out tasks, it learned too
    evaluator_log = (run_dir / "logs" / "evaluator.log").read_text()
    assert evaluator_log.count(f"held-out tasks every {Config().learner.eval_every} versions") == 2  # started twice
    assert not any("evaluation at version" in log.read_text() for log in (run_dir / "logs").glob("actor*.log"))
    assert all(r["actor/invalid_action_frac"] == 0 for r in rows)  # the raw template parses everything
    # The default trust region (4 minibatch updates a batch, issue 26): the clip acts.
    clipped = [r["learner/frac_clipped"] for r in rows]
    assert sum(c > 0 for c in clipped) >= len(rows) // 10, clipped  # 70 of 160 steps in a default run
    assert processes_mentioning(str(run_dir)) == []

    # The trained model, saved at the end, evaluated greedily on the held-out tasks.
    final = run_dir / "final"
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--model", str(final), "--env", "letters",
                           "--episodes", "64", "--out", str(tmp_path / "eval.json")],
                          capture_output=True, text=True, timeout=300)
    print(done.stdout[-1000:])
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = json.loads((tmp_path / "eval.json").read_text())
    assert result["episodes"] == 64 and result["reward"] > evals[0]["eval/reward"] + 0.2, result


@pytest.mark.timeout(patience(220))
def test_omrl_view_shows_the_runs_episodes_in_a_browser(default_run, tmp_path):
    """`omrl view` on the default run's directory, driven in headless Chromium: the list holds
    every kept episode, filters narrow it, a click opens an episode turn by turn with its tokens
    coloured, and the same task across steps lists its episodes. A screenshot is kept."""
    import shutil
    import urllib.error
    import urllib.request

    from broker.embedded import free_port
    from common.retry import wait_http
    from learner.samples import read_samples

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium and chromedriver on PATH: bash deploy/browser.sh installs Debian's (as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the test extra's selenium")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    kept = read_samples(default_run.run_dir)
    assert len(kept) >= 40
    port = free_port()
    viewer = subprocess.Popen([sys.executable, "-m", "deploy.cli", "view", str(default_run.run_dir), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1500,1000"):
        options.add_argument(flag)
    browser = None
    try:
        wait_http(f"http://127.0.0.1:{port}/api/episodes", 30.0, viewer.poll)
        with pytest.raises(urllib.error.HTTPError) as missing:  # a bad id: a 404 with a JSON error
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/episodes/no-such-id")
        assert missing.value.code == 404 and "no kept episode" in json.loads(missing.value.read())["error"]

        browser = webdriver.Chrome(service=webdriver.ChromeService(driver), options=options)
        browser.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(browser, 20)
        rows = lambda: browser.find_elements(By.CSS_SELECTOR, "#rows tr")  # noqa: E731
        wait.until(lambda _b: len(rows()) == len(kept))
        assert browser.find_element(By.ID, "summary").text == f"{len(kept)} of {len(kept)} kept episodes"

        # Filters: successes only, then the best episodes of steps 50 to 100.
        Select(browser.find_element(By.ID, "f-success")).select_by_value("true")
        wait.until(lambda _b: len(rows()) == sum(k["success"] for k in kept))
        browser.find_element(By.ID, "f-clear").click()
        wait.until(lambda _b: len(rows()) == len(kept))
        Select(browser.find_element(By.ID, "f-why")).select_by_value("best")
        browser.find_element(By.ID, "f-step-min").send_keys("50")
        browser.find_element(By.ID, "f-step-max").send_keys("100")
        best = sorted((k for k in kept if k["why"] == "best" and 50 <= k["step"] <= 100), key=lambda k: -k["step"])
        wait.until(lambda _b: len(rows()) == len(best))

        # The newest of them, opened: its header, its turns, its tokens coloured by log-prob.
        rows()[0].click()
        episode = best[0]
        wait.until(lambda b: b.find_elements(By.ID, "ep-title"))
        assert browser.find_element(By.ID, "ep-title").text == \
            f"step {episode['step']}, best: task {episode['task_id']} ({episode['env_name']})"
        assert browser.find_element(By.ID, "ep-reward").text == f"{episode['reward']:.3f}"
        turns = browser.find_elements(By.CSS_SELECTOR, "#episode .turn")
        assert [t.find_element(By.CLASS_NAME, "role").text for t in turns] == [t["role"] for t in episode["turns"]]
        for shown, turn in zip(turns, episode["turns"]):
            tokens = shown.find_elements(By.CLASS_NAME, "tok")
            assert len(tokens) == len(turn["tokens"])
            colours = [tok.value_of_css_property("background-color") for tok in tokens]
            if turn["role"] == "model":  # red, the more the less likely the token was: alpha 0.75 (1 - p), in 255ths
                alphas = [float(c.rsplit(",", 1)[1].rstrip(")")) if c.count(",") == 3 else 1.0 for c in colours]
                assert all(c.startswith("rgba(220, 50, 40,") or c == "rgb(220, 50, 40)" for c in colours), colours
                assert alphas == pytest.approx([0.75 * (1 - math.exp(lp)) for lp in turn["logprobs"]], abs=0.005)
            else:
                assert set(colours) == {"rgba(0, 0, 0, 0)"}, colours
        Select(browser.find_element(By.ID, "colour")).select_by_value("mask")
        model = browser.find_element(By.CSS_SELECTOR, "#episode .turn.model .tok")
        # Green where the learner trained: the model's tokens, unless the group had no signal.
        assert model.value_of_css_property("background-color") == (
            "rgba(60, 170, 90, 0.28)" if episode["trained"] else "rgba(0, 0, 0, 0)")

        # The same task across steps: every kept episode of it, oldest first.
        browser.find_element(By.ID, "across-btn").click()
        same = [k for k in kept if k["task_id"] == episode["task_id"] and k["env_name"] == episode["env_name"]]
        across = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#across-table tr.row"))
        assert [int(r.find_element(By.TAG_NAME, "td").text) for r in across] == sorted(k["step"] for k in same)
        artifacts = Path(os.environ.get("OMRL_TEST_ARTIFACTS", tmp_path))
        artifacts.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(artifacts / "omrl-view.png"))
        assert (artifacts / "omrl-view.png").read_bytes()[:4] == b"\x89PNG"
        print(f"screenshot: {artifacts / 'omrl-view.png'}")
    finally:
        if browser is not None:
            browser.quit()
        viewer.terminate()
        viewer.wait(10)


@pytest.mark.timeout(patience(80))
def test_ctrl_c_stops_every_process_and_two_ranks_resume_on_one(tmp_path):
    """The learner runs as 2 FSDP2 ranks under torchrun; Ctrl-C, with the env server hung
    (SIGSTOPped), stops every process (the ranks included) after a commit within one stop
    timeout a stage; the run then resumes from that checkpoint on 1 rank."""
    run_dir, shared = tmp_path / "run", tmp_path / "shared"
    # Weights as files in a shared directory (weights.dir) rather than in Redis.
    # No evaluator (its engine would start twice; its faults are the default run's above).
    proc = omrl("run", "--run-dir", str(run_dir), "--steps", "1000", "--set", "learner.ranks=2",
                "--set", 'learner.parallel="fsdp2"', "--set", f'weights.dir="{shared}"', "--set", "learner.eval_every=0")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 2 " in line:
            break
    assert any("step 2 " in line for line in lines), "".join(lines[-30:])
    assert len(processes_mentioning(str(run_dir))) >= 4  # env server, learner, two actors
    assert len(processes_mentioning(str(run_dir))) >= 6  # env server, torchrun and its 2 ranks, two actors
    env_server = [pid for pid in processes_mentioning(str(run_dir)) if " -m envs " in cmdline(pid)]
    assert len(env_server) == 1
    os.kill(env_server[0], signal.SIGSTOP)  # hung: the actors' episodes wait on it
    time.sleep(random.random())
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - began
    assert proc.returncode == 130, out[-3000:]
    # The actors' stage, then the learner's and the env server's: at most STOP_TIMEOUT_S each.
    assert took < 2 * STOP_TIMEOUT_S + 10, took
    assert processes_mentioning(str(run_dir)) == []
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "rank 1 of 2 on cpu (gloo)" in learner_log and "(fsdp2)" in learner_log
    stopped_at = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl"))

    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", "--run-dir", str(run_dir),
                           "--steps", str(stopped_at + 2), "--set", f'weights.dir="{shared}"', "--set",
                           "learner.eval_every=0"],
                          capture_output=True, text=True, timeout=patience(40))
    assert done.returncode == 0, done.stdout[-3000:]
    # The stop committed its last step; one rank read the checkpoint that two ranks wrote.
    assert f"step-{stopped_at:08d}: step {stopped_at}," in (run_dir / "logs" / "learner.log").read_text()
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps[-2:] == [stopped_at + 1, stopped_at + 2], steps  # went on from the 2-rank checkpoint
    files = sorted(shared.glob("v*.safetensors"))
    assert 1 <= len(files) <= 3 and not list(shared.glob("*.tmp-*"))  # the last learner.keep_versions, whole
    assert "applied weight version" in (run_dir / "logs" / "actor0.log").read_text()
    assert processes_mentioning(str(run_dir)) == []
