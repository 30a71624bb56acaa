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
