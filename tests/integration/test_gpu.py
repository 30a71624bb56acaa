"""The learner's CUDA path: device placement, bf16 autocast over fp32 master weights,
micro-batches, gradient checkpointing, the chunked output layer and the masked scoring of
actor.constrain_actions on a GPU. Skipped where
torch sees no GPU (CI's machine); run on a GPU machine with `pytest -m gpu`."""

import numpy as np
import pytest
import torch

from common.config import LearnerConfig
from common.models import init_tiny_model, load_causal_lm
from learner.batch import collate
from learner.scoring import PolicyScorer, plain_logprobs
from tests.unit.test_trainer import first_step, varied_groups

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """4 layers, hidden 256: enough that bf16 rounding shows, small enough to build in a second."""
    return str(init_tiny_model(tmp_path_factory.mktemp("wide"), hidden=256, layers=4, heads=4))


def test_auto_device_is_the_gpu_with_fp32_master_weights(wide_model):
    from learner.trainer import Trainer

    trainer = Trainer(load_causal_lm(wide_model), LearnerConfig(precision="bf16"))
    assert trainer.device.type == "cuda"
    assert all(p.is_cuda and p.dtype == torch.float32 for p in trainer.model.parameters())
    metrics = trainer.train_step(collate(varied_groups()))
    assert metrics["learner/skipped_nonfinite"] == 0 and metrics["learner/grad_norm"] > 0
    state = next(iter(trainer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32  # AdamW state in fp32 too


@pytest.mark.parametrize("precision, rtol, atol", [("fp32", 1e-4, 1e-6), ("bf16", 5e-2, 5e-4)])
def test_micro_batches_give_the_gradients_of_one_batch_on_cuda(wide_model, precision, rtol, atol):
    groups = varied_groups()
    whole, _ = first_step(wide_model, groups, precision=precision, max_tokens_per_microbatch=100_000)
    split, metrics = first_step(wide_model, groups, precision=precision, max_tokens_per_microbatch=100)
    assert metrics["learner/microbatches"] > 2
    # Gradient norms per tensor: bf16 rounds every matmul, so compare each tensor as a whole.
    for name, g in whole.items():
        assert float((split[name] - g).norm()) <= rtol * float(g.norm()) + atol, name


def test_gradient_checkpointing_gives_the_same_gradients(wide_model):
    groups = varied_groups()
    plain, _ = first_step(wide_model, groups)
    recomputed, _ = first_step(wide_model, groups, gradient_checkpointing=True)
    for name, g in plain.items():
        torch.testing.assert_close(recomputed[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_output_layer_matches_full_logits_on_cuda(wide_model):
    lm = load_causal_lm(wide_model).cuda()
    tokens = torch.randint(0, lm.config.vocab_size, (4, 64), device="cuda")
    rows = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(1, 64), indexing="ij"), -1).reshape(-1, 2).cuda()
    temperature = torch.full((len(rows),), 0.7, device="cuda")
    with torch.no_grad():
        ref_logp, ref_entropy = plain_logprobs(lm, tokens, rows, temperature)
        logp, entropy, _ = PolicyScorer(lm, vocab_chunk=16)(tokens, torch.ones_like(tokens), rows, temperature)
        torch.testing.assert_close(logp, ref_logp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(entropy, ref_entropy, rtol=1e-4, atol=1e-4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp16, _, _ = PolicyScorer(lm, vocab_chunk=16)(tokens, torch.ones_like(tokens), rows, temperature)
    assert logp16.dtype == torch.float32
    assert float((logp16 - ref_logp).abs().mean()) < 2e-2  # bf16 matmuls, fp32 softmax


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_step_through_a_real_nccl_group(wide_model, kind, monkeypatch):
    """Defect 1 of issue 25: every collective of a step (the trainer's sums, the gradient
    all-reduce or FSDP2's gathers, the global gradient norm) through the learner's NCCL group,
    one rank; CPU tensors must never reach NCCL."""
    from broker.embedded import free_port
    from learner.distributed import KINDS, resolve_device
    from learner.trainer import Trainer

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    parallel = KINDS[kind](resolve_device("cuda", 0))
    try:
        trainer = Trainer(load_causal_lm(wide_model), LearnerConfig(precision="bf16", minibatches=2), parallel=parallel)
        metrics = trainer.train_step(collate(varied_groups()))
        assert metrics["learner/skipped_nonfinite"] == 0 and metrics["learner/grad_norm"] > 0
    finally:
        parallel.close()


def test_sft_trains_on_the_gpu_in_bf16(wide_model):
    """Defect 5 of issue 25: `omrl sft` trained on the CPU in fp32 whatever the learner said."""
    from common.config import SFTConfig
    from learner.sft import SFTTrainer

    trainer = SFTTrainer(load_causal_lm(wide_model), LearnerConfig(precision="bf16", gradient_checkpointing=True),
                         SFTConfig(lr=1e-2, warmup=0, max_tokens_per_microbatch=64), total_steps=2)
    assert trainer.device.type == "cuda" and all(p.is_cuda and p.dtype == torch.float32
                                                  for p in trainer.scorer.parameters())
    examples = [([3 + i % 40 for i in range(n)], [int(i % 3 == 0) for i in range(n)]) for n in (7, 12, 30, 5, 18)]
    first = trainer.step(examples)
    assert first["sft/grad_norm"] > 0 and trainer.evaluate(examples) < first["sft/loss"]
    assert all(t.device.type == "cpu" for t in trainer.state_dict().values())  # what save_pretrained and vLLM take


def test_a_background_checkpoint_copies_what_the_gpu_had_queued_before_it(tmp_path):
    """The checkpoint's copy of CUDA tensors runs on a stream of its own: it must start after
    the work the caller's stream queued before `save_shards` (not before it lands), and must
    not see what the caller does once `copied` is done."""
    import torch.distributed.checkpoint as dcp

    from learner.checkpoint import save_shards

    weight = torch.zeros(4096, 4096, device="cuda")
    slow = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # tens of milliseconds queued ahead of the fill below
        slow = slow @ slow / 64
    weight.fill_(1.0).add_(slow.sum().nan_to_num() * 0)  # lands only after the matmuls
    copied, written = save_shards({"model": {"weight": weight}}, tmp_path, None, background=True)
    copied.result(timeout=60)
    weight.add_(5.0)  # after the copy: must not reach the checkpoint
    written.result(timeout=60)
    loaded = {"model": {"weight": torch.empty(4096, 4096)}}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(loaded["model"]["weight"], torch.ones(4096, 4096))


def masked_scores(lm, device: str, pair_chunk: int, seed: int = 0):
    """masked_logprobs over 64 rows of 1 to 40 allowed ids each (targets the last of them) and
    their gradients with respect to the hidden states and the output weight; beside them the
    reference: the full logits, every id a row does not allow at -inf."""
    from learner.scoring import masked_logprobs

    gen = torch.Generator().manual_seed(seed)
    weight = lm.get_output_embeddings().weight
    (V, H), M = weight.shape, 64
    hidden = torch.randn(M, H, generator=gen).to(device).requires_grad_()
    counts = torch.randint(1, 41, (M,), generator=gen)
    pair_rows = torch.repeat_interleave(torch.arange(M), counts).to(device)
    pair_ids = torch.cat([torch.randperm(V, generator=gen)[:int(c)] for c in counts]).to(device)
    targets = pair_ids[torch.cumsum(counts, 0).to(device) - 1]
    temperature = torch.full((M,), 0.7, device=device)
    logp, entropy = masked_logprobs(hidden, weight, targets, temperature, pair_rows, pair_ids, pair_chunk)
    grads = torch.autograd.grad((logp + 0.1 * entropy).sum(), [hidden, weight])
    with torch.no_grad(), torch.autocast(device, enabled=False):
        logits = (hidden.float() @ weight.float().T) / 0.7
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[pair_rows, pair_ids] = True
        ref = torch.log_softmax(logits.masked_fill(~allowed, -float("inf")), -1)
        ref_logp = ref.gather(1, targets[:, None]).squeeze(1)
        ref_entropy = -torch.where(allowed, ref.exp() * ref, 0.0).sum(-1)
    return logp, entropy, grads, ref_logp, ref_entropy


def test_masked_rows_are_scored_over_their_allowed_tokens_on_cuda(wide_model):
    """actor.constrain_actions' scoring on the GPU: in fp32 the pairs in one chunk and in many
    (each chunk's gathers recomputed in backward) give the reference's log-probs and entropies and
    the same gradients; under bf16 autocast, fp32 results near the reference."""
    lm = load_causal_lm(wide_model).cuda()
    logp, entropy, grads, ref_logp, ref_entropy = masked_scores(lm, "cuda", pair_chunk=100_000)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-4, atol=1e-4)
    chunked_logp, _, chunked_grads, _, _ = masked_scores(lm, "cuda", pair_chunk=97)  # about 14 chunks
    torch.testing.assert_close(chunked_logp, logp, rtol=1e-5, atol=1e-5)
    for whole, chunked in zip(grads, chunked_grads):
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-6)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp16, _, _, ref_logp, _ = masked_scores(lm, "cuda", pair_chunk=97)
    assert logp16.dtype == torch.float32
    assert float((logp16 - ref_logp).abs().mean()) < 2e-2  # bf16 products, fp32 sums


def masked_groups():
    """varied_groups with each sample's generated tokens masked as the actors' masks send them."""
    from tests.groups import mask_generated

    rng = np.random.default_rng(3)
    groups = varied_groups()
    for s in (s for group in groups for s in group.samples):
        mask_generated(s, rng)
    return groups


def test_a_masked_batch_trains_on_cuda_and_its_micro_batches_give_one_batch_s_gradients(wide_model):
    """The masked pairs travel to the GPU with each micro-batch (MicroBatch.allowed): one batch or
    many, bf16 or fp32, the same gradients, all finite."""
    groups = masked_groups()
    assert collate(groups).allowed is not None
    for precision, rtol, atol in (("fp32", 1e-4, 1e-6), ("bf16", 5e-2, 5e-4)):
        whole, metrics = first_step(wide_model, groups, precision=precision, max_tokens_per_microbatch=100_000)
        split, split_metrics = first_step(wide_model, groups, precision=precision, max_tokens_per_microbatch=100)
        assert metrics["learner/skipped_nonfinite"] == 0 and split_metrics["learner/microbatches"] > 2
        for name, g in whole.items():
            assert torch.isfinite(g).all(), name
            assert float((split[name] - g).norm()) <= rtol * float(g.norm()) + atol, name
