"""Weights over Redis's largest value (512 MiB by default) go by the blob transport in
chunks: a 143M-parameter float32 model with tied embeddings, built here, publishes as
safetensors bytes in 64 MiB chunks and loads whole on the actor's side."""

import asyncio
import os

import pytest
import torch
from safetensors.torch import load_file

from actors.weights import WeightGate, apply_newest
from broker.connection import connect
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.weights import REDIS_MAX_VALUE, WeightStore
from common.config import LearnerConfig
from common.models import init_tiny_model, load_causal_lm
from learner.trainer import Trainer

pytestmark = pytest.mark.redis


@pytest.mark.timeout(300)
def test_a_model_over_512_mib_publishes_in_chunks_and_loads_whole(tmp_path, run_name):
    path = init_tiny_model(tmp_path / "m143", hidden=1024, layers=14, heads=16, tie_embeddings=True)
    trainer = Trainer(load_causal_lm(str(path)), LearnerConfig())
    state = trainer.hf_state()
    blob = str(tmp_path / "published.safetensors")  # as the learner publishes: a file, read a chunk at a time
    size = trainer.save_weights(blob)
    assert size > REDIS_MAX_VALUE and "lm_head.weight" not in state  # tied: saved once
    loaded = {}

    async def load(file):
        loaded.update(load_file(file))

    async def scenario():
        with EmbeddedRedis() as server:  # the server's default proto-max-bulk-len: 512 MiB
            client = connect(server.url)
            assert int((await client.config_get("proto-max-bulk-len"))["proto-max-bulk-len"]) == REDIS_MAX_VALUE
            store = WeightStore(client, Keys(run_name), keep=1)
            record = await store.publish(1, 1, blob)
            gate = WeightGate(0)
            assert await apply_newest(store, gate, load, str(tmp_path))
            await client.aclose()
            return record, gate

    record, gate = asyncio.run(scenario())
    assert record["chunks"] == -(-size // (64 << 20)) >= 9 and record["nbytes"] == size and gate.version == 1
    assert not os.path.exists(blob)  # publish took the file
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert not list(tmp_path.glob("v1.safetensors"))  # the fetched file is deleted once loaded
