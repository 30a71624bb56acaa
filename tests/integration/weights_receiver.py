"""An actor's weight receiver on its own, as a process, for the broadcast tests:

    python -m tests.integration.weights_receiver REDIS_URL RUN OUT [--model DIR] [--hang]

It runs the actor's receiver (`receive_weights` with a `BroadcastLink`) into a real vLLM
engine (--model: it then writes, for each version applied, the greedy continuation of a
prompt and its log-probs) or into `TensorEngine`, which stands in for vLLM's worker and
writes a checksum of each tensor. One JSON line per version to OUT. --hang: the first
time it is asked for weights, the process stops itself (SIGSTOP) after asking: a hung peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

PROMPT = "U: Say e"


class TensorEngine:
    """What vLLM's worker does with a broadcast, minus vLLM: join the group, receive versions."""

    workers = 1

    def __init__(self, hang: bool = False):
        self.hang, self.group, self.received = hang, None, {}

    async def join_weights(self, host, port, link, backend, timeout_s):
        from common.weight_sync import open_group, open_store

        def join():
            self.group = open_group(open_store(host, port, timeout_s), link, 1, 2, backend, timeout_s)

        await asyncio.to_thread(join)

    async def receive_weights(self) -> int:
        from common.weight_sync import receive_version

        if self.hang:
            self.hang = False
            os.kill(os.getpid(), signal.SIGSTOP)  # asked, then hung: the learner's send must time out

        def receive():
            version, tensors = receive_version(self.group, "cpu")
            self.received = {name: float(t.double().sum()) for name, t in tensors}
            return version

        try:
            return await asyncio.to_thread(receive)
        except BaseException:
            self.group = None
            raise

    async def load_weights(self, path):
        raise AssertionError("this test publishes by broadcast only")


async def main(url: str, run: str, out: str, model: str | None, hang: bool) -> None:
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
        engine = TensorEngine(hang)
    store, stop = WeightStore(connect(url), Keys(run)), asyncio.Event()
    gate = WeightGate(0, pause=getattr(engine, "pause", None), resume=getattr(engine, "resume", None))
    link = BroadcastLink(engine, f"receiver-{os.getpid()}", timeout_s=float(os.environ.get("TIMEOUT_S", "5")))
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
    if model:
        engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("run")
    parser.add_argument("out")
    parser.add_argument("--model")
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.run, args.out, args.model, args.hang))
