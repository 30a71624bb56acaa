"""`omrl bench onednn [--minutes N]`: what oneDNN's process-wide kernel cache costs vLLM's
CPU worker over time. Two offline engines on the tiny model, side by side on the same cores for
N minutes (8; `--quick`: 1), each generating greedily for batches of 1-24 prompts of 5-200
characters and 1-40 new tokens (the same random sequence in both): the system as the actors
and the evaluator start it (`share_cpus`: the cache off), the baseline with oneDNN's default
of 1,024 kernels kept. vLLM's CPU matmuls keep 32 compiled kernels per layer of their own; the
global cache keeps one more for each token count a batch brings, which is what grew the
evaluator's worker in the 2-hour soak.

Rows: vLLM's processes' resident memory at the end (lower is better; the ratio is baseline /
system) and its growth after the first tenth of the calls, and generate calls per second (both
engines share the cores alike, so the ratio compares them). Run by name only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import pyplot, row
from benchmarks.soak import proc_table, usage

SAMPLE_EVERY = 10  # generate calls between samples
LETTERS = "abcdefghijklmnopqrstuvwxyz "


def run(quick: bool, device: str = "cpu", minutes: float | None = None, out: Path | None = None) -> dict:
    if device != "cpu":
        raise SystemExit("error: omrl bench onednn measures vLLM's CPU backend: --device cpu")
    minutes = minutes or (1.0 if quick else 8.0)
    from common.models import init_tiny_model

    with tempfile.TemporaryDirectory(prefix="omrl-onednn-") as root:
        model = init_tiny_model(Path(root) / "model")
        arms = {"system": None, "baseline": "1024"}  # None: share_cpus sets it, as in a run
        procs = {}
        for name, capacity in arms.items():
            env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
            if capacity is not None:
                env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.onednn", str(model), str(minutes * 60), f"{root}/{name}.json"],
                env=env, stdout=open(f"{root}/{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            for name, proc in procs.items():
                if proc.wait() != 0:
                    raise RuntimeError(f"the {name} engine failed: {Path(root, name + '.log').read_text()[-3000:]}")
        finally:  # vLLM's engine processes outlive the arm's own exit: each arm's group goes whole
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        samples = {name: json.loads(Path(root, f"{name}.json").read_text()) for name in arms}
    end = {name: s[-1] for name, s in samples.items()}
    growth = {name: s[-1]["rss_mb"] - s[len(s) // 10]["rss_mb"] for name, s in samples.items()}
    rate = {name: s[-1]["calls"] / s[-1]["t"] for name, s in samples.items()}
    return {"minutes": minutes, "samples": samples, "growth_mb": growth,
            "rows": [{**row(f"vLLM's resident memory after {minutes:g} min, MB (lower is better; ratio is baseline / "
                            f"system); grew {growth['system']:+.0f} MB against {growth['baseline']:+.0f} after the "
                            "first tenth of the calls", [end["baseline"]["rss_mb"]], [end["system"]["rss_mb"]]),
                      "system": end["system"]["rss_mb"], "baseline": end["baseline"]["rss_mb"]},
                     row("generate calls/s, the two engines side by side", [rate["system"]], [rate["baseline"]])]}


def arm(model: str, seconds: float, out: str) -> None:
    """One engine generating for `seconds`; its samples (time, calls, vLLM's processes' RSS) to `out`."""
    from actors.engine import engine_args, share_cpus
    from common.config import Config

    share_cpus()
    from vllm import LLM, SamplingParams

    cfg = Config()
    llm = LLM(**engine_args(cfg.model, cfg.actor, model, 0))
    rng, samples, calls = random.Random(0), [], 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        prompts = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(5, 200))) for _ in range(rng.randint(1, 24))]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=rng.randint(1, 40)), use_tqdm=False)
        calls += 1
        if calls % SAMPLE_EVERY == 0:
            samples.append({"t": time.monotonic() - started, "calls": calls, "rss_mb": usage(descendants())["rss_mb"]})
    Path(out).write_text(json.dumps(samples))
    os._exit(0)  # vLLM's teardown at exit can hang; the caller kills the engine's processes with the arm's group


def descendants() -> list[int]:
    """This process's children, theirs, and so on."""
    table, found = proc_table(), [os.getpid()]
    for pid in found:  # grows as it goes: breadth first
        found += [child for child, (ppid, _) in table.items() if ppid == pid]
    return found[1:]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, label in (("system", "cache off (the default here)"), ("baseline", "oneDNN's default: 1,024 kept")):
        s = result["samples"][name]
        ax.plot([x["calls"] for x in s], [x["rss_mb"] for x in s], label=label)
    ax.set_xlabel("generate calls (batches of 1-24 prompts of random length)")
    ax.set_ylabel("vLLM's processes' resident memory, MB")
    ax.set_title("omrl bench onednn: oneDNN's kernel cache in vLLM's CPU worker", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    arm(sys.argv[1], float(sys.argv[2]), sys.argv[3])
