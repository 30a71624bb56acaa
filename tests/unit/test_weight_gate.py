import asyncio

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
    async def scenario():
        gate = WeightGate(version=0)

        async def generate(delay, hold):
            await asyncio.sleep(delay)
            async with gate.generating():
                await asyncio.sleep(hold)

        # busy 0.00-0.15 (two calls overlapping), idle 0.15-0.30, busy 0.30-0.40
        await asyncio.gather(generate(0.0, 0.1), generate(0.05, 0.1), generate(0.3, 0.1))
        mid = gate.generating_s
        async with gate.generating():
            await asyncio.sleep(0.05)
            during = gate.generating_s  # a call in flight counts up to now
        return mid, during

    mid, during = asyncio.run(scenario())
    assert 0.24 <= mid <= 0.32, mid
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
    assert gate.version == 1 and gate.update_s < 1.0 and gate.blocked_s > 0


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

        async def reset_prefix_cache(self):
            self.calls.append("reset")
            self.refusals -= 1
            return self.refusals < 0

    engine = object.__new__(VLLMEngine)  # the engine's own load, on a stub of vLLM
    gate = WeightGate(0)  # drain mode: no pause, no resume
    engine.llm = StubLLM(refusals=2)
    asyncio.run(gate.apply(1, lambda: engine.load_weights("/w")))
    assert engine.llm.calls == ["omrl_reload_weights", "reset", "reset", "reset"] and gate.version == 1
    engine.llm = StubLLM(refusals=RESET_ATTEMPTS)
    with pytest.raises(RuntimeError, match="prefix cache"):
        asyncio.run(gate.apply(2, lambda: engine.load_weights("/w")))
    assert gate.broken and gate.version == 1 and engine.llm.calls.count("reset") == RESET_ATTEMPTS
