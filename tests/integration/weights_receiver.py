"""An actor's weight receiver on its own, as a process, for the broadcast tests:

    python -m tests.integration.weights_receiver REDIS_URL RUN OUT [--model DIR]

It runs the actor's receiver (`receive_weights` with a `BroadcastLink`: a member of the
learner's weight group that relays and stages each version) into a real vLLM engine
(--model: it then writes, for each version applied, the greedy continuation of a prompt and
its log-probs) or into `TensorEngine`, which loads the staged file and writes a checksum of
each tensor. One JSON line per version to OUT. SIGTERM: the receiver leaves the group and
exits; a test stops it (SIGSTOP) to make a hung actor. STAGING_DIR: where it stages versions
(a test gives one it cannot write to).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import tempfile

PROMPT = "U: Say e"


class TensorEngine:
    """What vLLM's worker does with a staged version, minus vLLM: load the file."""

    def __init__(self):
        self.received = {}

    async def load_weights(self, path):
        from safetensors.torch import load_file

        self.received = {name: float(t.double().sum()) for name, t in load_file(path).items()}


async def main(url: str, run: str, out: str, model: str | None) -> None:
    from actors.weights import BroadcastLink, WeightGate, receive_weights
    from broker.connection import connect
    from broker.keys import Keys
    from broker.weights import WeightStore

    if model:
        from actors.engine import VLLMEngine
        from common.config import load_config

        cfg = load_config(None, [f"model.path='{model}'"], environ={})
        engine = VLLMEngine(cfg.model, cfg.actor, model, seed=0)
    else:
        engine = TensorEngine()
    store, stop = WeightStore(connect(url), Keys(run)), asyncio.Event()
    gate = WeightGate(0, pause=getattr(engine, "pause", None), resume=getattr(engine, "resume", None))
    staging = os.environ.get("STAGING_DIR") or tempfile.mkdtemp(prefix="omrl-receiver-")  # a test's unwritable one
    link = BroadcastLink(f"receiver-{os.getpid()}", staging, timeout_s=float(os.environ.get("TIMEOUT_S", "5")))
    receiver = asyncio.create_task(receive_weights(store, gate, engine.load_weights, 0.2, stop, link=link))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    reported = 0
    with open(out, "a") as f:
        while not stop.is_set():
            if gate.version != reported and not gate.broken:
                reported = gate.version
                line = {"version": reported, "pid": os.getpid()}
                if model:
                    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
                    async with gate.generating() as version:
                        gen = await engine.generate(prompt, 8, temperature=0.0)
                    line.update(version=version, tokens=gen.token_ids, logprobs=gen.logprobs)
                else:
                    line["sums"] = engine.received
                f.write(json.dumps(line) + "\n")
                f.flush()
            await asyncio.sleep(0.05)
    await receiver
    link.close()  # leaves the learner's group
    if not os.environ.get("STAGING_DIR"):
        shutil.rmtree(staging, ignore_errors=True)
    if model:
        engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("run")
    parser.add_argument("out")
    parser.add_argument("--model")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.run, args.out, args.model))
