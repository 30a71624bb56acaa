import asyncio
import time

from actors.weights import WeightGate


def test_update_waits_for_in_flight_calls_and_blocks_new_ones():
    async def scenario():
        gate = WeightGate(version=0)
        log = []

        async def generate(name, hold):
            async with gate.generating() as version:
                log.append((name, "start", version))
                await asyncio.sleep(hold)
                log.append((name, "end", version))

        async def load():
            log.append(("update", "load", None))
            await asyncio.sleep(0.01)

        first = asyncio.create_task(generate("a", 0.05))
        await asyncio.sleep(0.01)
        update = asyncio.create_task(gate.apply(1, load))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(generate("b", 0.0))
        await asyncio.gather(first, update, second)
        return gate, log

    gate, log = asyncio.run(scenario())
    assert log == [("a", "start", 0), ("a", "end", 0), ("update", "load", None), ("b", "start", 1), ("b", "end", 1)]
    assert gate.version == 1 and gate.applied == 1


def test_generating_time_counts_overlapping_calls_once_and_idle_time_not_at_all():
    """Compared with the union of the calls' own measured spans, not with the sleeps' nominal
    lengths (on a loaded machine a 0.1 s sleep can take several times that; one CI machine's
    did); events, not delays, make the overlap and the idle gap, so a slow machine keeps both."""
    async def scenario():
        gate = WeightGate(version=0)
        spans = []
        first_in, second_in = asyncio.Event(), asyncio.Event()

        async def call(hold, entered, wait_for=None):
            async with gate.generating():
                start = time.monotonic()
                entered.set()
                if wait_for is not None:
                    await wait_for.wait()
                await asyncio.sleep(hold)
                spans.append((start, time.monotonic()))

        async def second():
            await first_in.wait()
            await call(0.1, second_in)

        # two calls overlapping by at least 0.05 s, then at least 0.15 s idle, then one call
        await asyncio.gather(call(0.05, first_in, wait_for=second_in), second())
        await asyncio.sleep(0.15)
        await call(0.1, asyncio.Event())
        mid = gate.generating_s
        async with gate.generating():
            await asyncio.sleep(0.05)
            during = gate.generating_s  # a call in flight counts up to now
        return mid, during, spans

    mid, during, spans = asyncio.run(scenario())
    busy, end = 0.0, float("-inf")  # the union of the spans' lengths
    for start, stop in sorted(spans):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    assert sum(stop - start for start, stop in spans) - busy >= 0.045  # the overlap, counted twice, would show
    assert busy - 0.01 <= mid <= busy + 0.02, (mid, busy, spans)  # once, and not the idle 0.15 s
    assert during - mid >= 0.045, (mid, during)


def test_an_interrupting_update_pauses_running_calls_but_waits_for_pinned_ones():
    """interrupt mode: the update does not wait for the running call (the engine's pause ends it
    early), but waits for a pinned one (an evaluation); a call after it runs on the new version."""
    async def scenario():
        log, paused = [], asyncio.Event()

        async def pause():
            log.append("pause")
            paused.set()

        async def resume():
            log.append("resume")
            paused.clear()

        gate = WeightGate(0, pause=pause, resume=resume)

        async def running():  # a long request: returns when the engine pauses
            async with gate.generating() as version:
                gate.sent()  # what the engine calls once the request is in it
                await asyncio.wait_for(paused.wait(), 5)
                log.append(("running aborted", version))
            async with gate.generating() as version:
                log.append(("running continues", version))

        async def pinned():
            async with gate.generating(pinned=True) as version:
                await asyncio.sleep(0.1)
                log.append(("pinned done", version))

        async def load():
            log.append("load")
            return None

        tasks = [asyncio.create_task(running()), asyncio.create_task(pinned())]
        await asyncio.sleep(0.01)
        await gate.apply(1, load)
        await asyncio.gather(*tasks)
        return gate, log

    gate, log = asyncio.run(scenario())
    # (when the aborted call sees its abort against the load is up to the scheduler)
    assert log[:2] == [("pinned done", 0), "pause"] and log[-1] == ("running continues", 1)
    assert log.index("load") < log.index("resume") and ("running aborted", 0) in log and len(log) == 6
    # Waiting for the running call would take its 5 s wait_for; a loaded machine took 1.1 s without it.
    assert gate.version == 1 and gate.update_s < 3.0 and gate.blocked_s > 0


def test_a_failed_load_keeps_generation_out_until_a_version_loads_whole():
    async def scenario():
        gate, started = WeightGate(0), []

        async def generate():
            async with gate.generating() as version:
                started.append(version)

        async def broken():
            raise RuntimeError("connection closed mid-transfer")

        try:
            await gate.apply(1, broken)
        except RuntimeError:
            pass
        waiting = asyncio.create_task(generate())
        await asyncio.sleep(0.1)
        assert gate.broken and not started and gate.failed == 1  # nothing runs on part-loaded weights

        async def whole():
            return 5  # broadcast: the version the learner sent

        await gate.apply(2, whole)
        await asyncio.wait_for(waiting, 1)
        return gate, started

    gate, started = asyncio.run(scenario())
    assert started == [5] and gate.version == 5 and not gate.broken


def test_an_interrupting_update_pauses_only_once_every_running_call_has_sent_its_request():
    """A call that entered the gate but whose request is not in the engine yet would, sent after
    the pause, run on the new weights under the old version's label: the pause waits for it."""
    async def scenario():
        log = []

        async def pause():
            log.append("pause")

        async def resume():
            log.append("resume")

        gate = WeightGate(0, pause=pause, resume=resume)
        entered, release = asyncio.Event(), asyncio.Event()

        async def slow_to_send():
            async with gate.generating():
                entered.set()
                await release.wait()  # e.g. the engine still processing the prompt
                log.append("sent")
                gate.sent()
                await asyncio.sleep(0.05)

        async def load():
            log.append("load")

        call = asyncio.create_task(slow_to_send())
        await entered.wait()
        update = asyncio.create_task(gate.apply(1, load))
        await asyncio.sleep(0.1)
        assert log == []  # the pause waits for the request to be sent
        release.set()
        await asyncio.gather(call, update)
        return log

    assert asyncio.run(scenario()) == ["sent", "pause", "load", "resume"]


def test_every_load_empties_the_prefix_cache_even_without_a_pause():
    """A draining update (no pause) loads between calls: the prefix cache must still be emptied,
    or a prompt that hits it reuses KV the old weights computed under the new version's label.
    vLLM refuses while an ended request's blocks are not yet freed: the load retries, then fails
    (the gate keeps generation out) rather than go on with the old KV."""
    import pytest

    from actors.engine import RESET_ATTEMPTS, VLLMEngine

    class StubLLM:
        def __init__(self, refusals: int):
            self.calls, self.refusals = [], refusals

        async def collective_rpc(self, name, args):
            self.calls.append(name)
            return [{}]  # each worker's requests: none

        async def reset_prefix_cache(self):
            self.calls.append("reset")
            self.refusals -= 1
            return self.refusals < 0

    engine = object.__new__(VLLMEngine)  # the engine's own load, on a stub of vLLM
    engine._swaps, engine._loads, engine._kept = {}, 0, False
    gate = WeightGate(0)  # drain mode: no pause, no resume
    engine.llm = StubLLM(refusals=2)
    asyncio.run(gate.apply(1, lambda: engine.load_weights("/w")))
    assert engine.llm.calls == ["omrl_reload_weights", "reset", "reset", "reset"] and gate.version == 1
    engine.llm = StubLLM(refusals=RESET_ATTEMPTS)
    with pytest.raises(RuntimeError, match="prefix cache"):
        asyncio.run(gate.apply(2, lambda: engine.load_weights("/w")))
    assert gate.broken and gate.version == 1 and engine.llm.calls.count("reset") == RESET_ATTEMPTS


class KeepingEngine:
    """A fake engine that samples one token per 10 ms while not paused; `pause(keep=True)` holds
    its requests where they are, and a load notes each one's token count, as VLLMEngine does."""

    def __init__(self):
        self.running, self.requests, self.calls = asyncio.Event(), {}, 0
        self.running.set()

    async def generate(self, prompt_ids, max_tokens, temperature=None, turn_start=None, sent=None, stops=None,
                       choices=None):
        from actors.engine import Generation

        self.calls += 1
        tokens, swaps = [], []
        self.requests[id(tokens)] = (tokens, swaps)
        sent()
        while len(tokens) < max_tokens:
            await self.running.wait()
            tokens.append(len(tokens))
            await asyncio.sleep(0.01)
        del self.requests[id(tokens)]
        return Generation(tokens, [0.0] * len(tokens), "length", swaps)

    async def pause(self, keep=False):
        assert keep
        self.running.clear()

    async def load_weights(self, path):
        for tokens, swaps in self.requests.values():
            swaps.append(len(tokens))

    async def resume(self):
        self.running.set()


def test_a_kept_update_labels_tokens_after_each_swap_with_its_version_without_a_continuation():
    """keep mode: a turn runs through two updates in one engine call (no abort, no continuation);
    its tokens before the first swap are version 0, then 3, then 4, cut where the engine counted
    them; a turn that starts after an update runs on its version alone."""
    from actors.episode import ModelPolicy, labels
    from actors.weights import update_gate

    async def scenario():
        engine = KeepingEngine()
        gate = update_gate("keep", engine)
        policy = ModelPolicy(engine, gate)
        turn = asyncio.create_task(policy.act([1, 2], 40, env_id=0))
        for version in (3, 4):
            await asyncio.sleep(0.1)
            await gate.apply(version, lambda: engine.load_weights("/w"))
        later = await policy.act([1], 5, env_id=0)
        return await turn, later, engine

    turn, later, engine = asyncio.run(scenario())
    versions = turn.version
    swaps = [versions.index(3), versions.index(4)]
    assert engine.calls == 2 and turn.generation.finish_reason == "length" and len(versions) == 40
    assert 0 < swaps[0] < swaps[1] < 40 and versions == labels(0, swaps, [3, 4], 40)
    assert later.version == [4] * 5
    assert labels(0, [2, 9], [1, 2], 4) == [0, 0, 1, 1]  # a swap past the call's last token: none of them


def test_a_kept_load_counts_each_request_s_tokens_and_a_failed_one_aborts_them():
    """VLLMEngine paused with its requests kept: the load records each request's token count as
    the worker reports it (0 for one not yet scheduled) and leaves the prefix cache alone (its
    blocks are in use: the cache salt keeps later requests off them); a load that fails aborts
    the kept requests, which must not go on with weights half loaded."""
    import pytest

    from actors.engine import VLLMEngine

    class StubLLM:
        def __init__(self, fail=False):
            self.calls, self.fail = [], fail

        async def collective_rpc(self, name, args):
            self.calls.append(name)
            if self.fail:
                raise RuntimeError("the file is truncated")
            return [{"r0": 7}]

        async def pause_generation(self, mode, clear_cache):
            self.calls.append(mode)

        async def resume_generation(self):
            self.calls.append("resume")

        async def reset_prefix_cache(self):
            self.calls.append("reset")
            return True

    engine = object.__new__(VLLMEngine)
    engine._swaps, engine._loads, engine._kept = {"r0": [], "r1": []}, 0, False
    engine.llm = StubLLM()
    gate = WeightGate(0, pause=lambda: engine.pause(keep=True), resume=engine.resume)
    asyncio.run(gate.apply(1, lambda: engine.load_weights("/w")))
    assert engine.llm.calls == ["keep", "omrl_reload_weights", "resume"] and engine._loads == 1
    assert engine._swaps == {"r0": [7], "r1": [0]}
    engine.llm = StubLLM(fail=True)
    with pytest.raises(RuntimeError, match="truncated"):
        asyncio.run(gate.apply(2, lambda: engine.load_weights("/w")))
    assert engine.llm.calls == ["keep", "omrl_reload_weights", "abort", "resume"] and gate.broken


def test_stalled_time_is_work_held_without_anything_finishing_and_nothing_while_idle():
    """What an actor's liveness reads (common/liveness.py): a wedged engine's calls never end."""
    async def scenario():
        gate = WeightGate(version=0)
        wedged, release = asyncio.Event(), asyncio.Event()
        assert gate.stalled_s() == 0.0
        await asyncio.sleep(0.2)  # idle time is no stall, and does not count once work starts

        async def generate(until: asyncio.Event | None, hold: float = 0.0):
            async with gate.generating():
                wedged.set()
                if until is not None:
                    await until.wait()
                await asyncio.sleep(hold)

        stuck = asyncio.create_task(generate(release))
        await wedged.wait()
        assert gate.stalled_s() < 0.1
        # Other calls finishing beside the stuck one are progress: the engine still answers.
        for _ in range(3):
            await generate(None, 0.05)
            assert gate.stalled_s() < 0.05
        await asyncio.sleep(0.3)
        held = gate.stalled_s()
        assert 0.3 <= held < 1.0, held
        release.set()
        await stuck
        assert gate.stalled_s() == 0.0

        async def hung_load():
            await asyncio.sleep(0.2)
        update = asyncio.create_task(gate.apply(1, hung_load))
        await asyncio.sleep(0.1)
        assert 0.05 <= gate.stalled_s() < 0.2  # an update under way is work too
        await update
        return gate.stalled_s()

    assert asyncio.run(scenario()) == 0.0

