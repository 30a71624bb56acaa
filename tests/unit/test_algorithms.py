"""Advantages and the off-policy loss against a small NumPy reference."""

import numpy as np
import pytest
import torch

from learner.algorithms import (
    ESTIMATORS,
    LossConfig,
    advantages,
    discounted_returns,
    gae,
    gigpo_step_advantages,
    has_signal,
    kl_penalty,
    loss_metrics,
    policy_loss,
    tis_loss,
    vtrace,
)
from learner.scoring import head_logprobs, masked_logprobs


def np_grpo(rewards, scale=True):
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    return centered / (rewards.std(axis=1, ddof=1, keepdims=True) + 1e-6) if scale else centered


def np_loss(lc, lp, lb, adv, mask, C=2.0, reject=5.0, eps_low=0.2, eps_high=0.28, dual=None):
    adv = np.broadcast_to(adv[:, None], lc.shape)
    behav = np.exp(lp - lb)
    m = mask * (behav <= reject)
    w = np.minimum(behav, C)
    r = np.exp(lc - lp)
    obj = np.minimum(r * adv, np.clip(r, 1 - eps_low, 1 + eps_high) * adv)
    if dual is not None:
        obj = np.where(adv < 0, np.maximum(obj, dual * adv), obj)
    return -(m * w * obj).sum() / mask.sum()  # over the trained tokens, rejected ones included


def np_tis(lc, lb, adv, mask, C=2.0, reject=5.0):
    """TIS's loss value, and its gradient in lc (the weight carries none): -m w A / n."""
    adv = np.broadcast_to(adv[:, None], lc.shape)
    ratio = np.exp(lc - lb)
    m = mask * (ratio <= reject)
    w = np.minimum(ratio, C)
    return -(m * w * lc * adv).sum() / mask.sum(), -(m * w * adv) / mask.sum()


def np_rloo(rewards):
    """Each sample's baseline: the mean of the other G - 1 rewards of its group (a loop, as written)."""
    n, G = rewards.shape
    out = np.zeros_like(rewards)
    for g in range(n):
        for i in range(G):
            others = [rewards[g, j] for j in range(G) if j != i]
            out[g, i] = rewards[g, i] - sum(others) / (G - 1)
    return out


def test_advantage_estimators_match_numpy():
    rewards = np.random.default_rng(0).random((4, 6)).astype(np.float32)
    groups = [torch.from_numpy(r) for r in rewards]
    expected = {"grpo": np_grpo(rewards, True), "drgrpo": np_grpo(rewards, False), "rloo": np_rloo(rewards),
                "reinforce": rewards - rewards.mean()}
    assert set(expected) == set(ESTIMATORS)
    for name, want in expected.items():
        got, signal = advantages(name, groups)
        np.testing.assert_allclose(torch.stack(got).numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert signal == [True] * 4


def test_groups_with_equal_rewards_have_no_signal_unless_the_baseline_is_the_batch():
    rewards = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])]  # groups may differ in size
    assert has_signal(torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])).tolist() == [False, True]
    for name in ("grpo", "drgrpo", "rloo"):
        got, signal = advantages(name, rewards)
        assert signal == [False, True] and torch.all(got[0] == 0) and got[1].shape == (4,), name
    got, signal = advantages("reinforce", rewards)  # baseline 4/7: the equal group is above it
    assert signal == [True, True]
    np.testing.assert_allclose(torch.cat(got).numpy(), np.array([1, 1, 1, 0, 1, 0, 0]) - 4 / 7, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*learner.algorithm"):
        advantages("ppo", rewards)


@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_matches_numpy(dual):
    rng = np.random.default_rng(1)
    N, T = 6, 9
    lb = rng.normal(-2, 0.5, (N, T)).astype(np.float32)
    lp = (lb + rng.normal(0, 0.6, (N, T))).astype(np.float32)  # some tokens past C and past reject
    lc = (lp + rng.normal(0, 0.3, (N, T))).astype(np.float32)  # some ratios outside the clip range
    adv = rng.normal(0, 1, N).astype(np.float32)
    mask = (rng.random((N, T)) > 0.3).astype(np.float32)
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, behav_weight_cap=2.0, behav_reject=5.0, dual_clip=dual)
    loss, stats = policy_loss(*(torch.from_numpy(x) for x in (lc, lp, lb, adv, mask)), cfg)
    metrics = loss_metrics(stats)
    expected = np_loss(lc, lp, lb, adv, mask, eps_high=0.28, dual=dual)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    behav = np.exp(lp - lb)[mask > 0]
    assert metrics["frac_rejected"] == pytest.approx((behav > 5).mean())
    assert metrics["frac_truncated"] == pytest.approx(((behav > 2) & (behav <= 5)).mean())
    w = np.minimum(behav[behav <= 5], 2.0)
    assert metrics["ess"] == pytest.approx(w.sum() ** 2 / (w.size * (w ** 2).sum()), rel=1e-5)
    assert 0 < metrics["frac_clipped"] < 1


def test_policy_gradient_matches_numpy_finite_difference():
    rng = np.random.default_rng(2)
    N, T = 3, 4
    lb = rng.normal(-1, 0.2, (N, T))
    lp = lb + rng.normal(0, 0.1, (N, T))
    lc = lp + rng.normal(0, 0.05, (N, T))
    adv, mask = rng.normal(0, 1, N), np.ones((N, T))
    cur = torch.tensor(lc, requires_grad=True)
    loss, _ = policy_loss(cur, torch.tensor(lp), torch.tensor(lb), torch.tensor(adv), torch.tensor(mask),
                          LossConfig(clip_eps_high=0.28))
    loss.backward()
    i, j, h = 1, 2, 1e-6
    bumped = lc.copy()
    bumped[i, j] += h
    numeric = (np_loss(bumped, lp, lb, adv, mask) - np_loss(lc, lp, lb, adv, mask)) / h
    assert float(cur.grad[i, j]) == pytest.approx(numeric, rel=1e-3, abs=1e-7)


def test_tis_loss_and_its_gradient_match_numpy():
    rng = np.random.default_rng(4)
    N, T = 6, 9
    lb = rng.normal(-2, 0.5, (N, T))
    lc = lb + rng.normal(0, 0.8, (N, T))  # some weights past C, some past reject
    adv = rng.normal(0, 1, N)
    mask = (rng.random((N, T)) > 0.3).astype(np.float64)
    cur = torch.tensor(lc, requires_grad=True)
    loss, stats = tis_loss(cur, *(torch.tensor(x) for x in (lb, adv, mask)), LossConfig())
    loss.backward()
    expected, grad = np_tis(lc, lb, adv, mask)
    assert float(loss) == pytest.approx(expected, rel=1e-9)
    np.testing.assert_allclose(cur.grad.numpy(), grad, rtol=1e-9, atol=1e-12)
    ratio = np.exp(lc - lb)[mask > 0]
    metrics = loss_metrics(stats)
    assert 0 < metrics["frac_truncated"] == pytest.approx(((ratio > 2) & (ratio <= 5)).mean())
    assert 0 < metrics["frac_rejected"] == pytest.approx((ratio > 5).mean())
    # Unlike PPO's clip, a truncated token still has a gradient (scaled to C); a rejected one has none.
    truncated, rejected = (np.exp(lc - lb) > 2) & (np.exp(lc - lb) <= 5), np.exp(lc - lb) > 5
    assert (cur.grad.numpy()[truncated & (mask > 0)] != 0).all()
    assert (cur.grad.numpy()[rejected] == 0).all()


def test_on_policy_loss_is_minus_mean_advantage():
    N, T = 2, 3
    lp = torch.full((N, T), -1.0)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    loss, stats = policy_loss(lp.clone(), lp, lp, adv, mask, LossConfig())
    metrics = loss_metrics(stats)
    assert float(loss) == pytest.approx(-(3 * 1 - 1) / 4)
    assert metrics["ess"] == pytest.approx(1.0) and metrics["mismatch_kl"] == pytest.approx(0.0)


def np_head(h, W, targets, temperature):
    logits = (h.astype(np.float64) @ W.astype(np.float64).T) / temperature[:, None]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(targets)), targets], -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("vocab_chunk", [7, 64, 1000])  # 7 and 64 do not divide V
def test_chunked_head_matches_numpy(vocab_chunk):
    rng = np.random.default_rng(3)
    M, H, V = 23, 8, 300
    h, W = rng.normal(0, 1, (M, H)).astype(np.float32), rng.normal(0, 0.5, (V, H)).astype(np.float32)
    targets, temperature = rng.integers(0, V, M), rng.uniform(0.5, 1.5, M).astype(np.float32)
    logp, entropy = head_logprobs(torch.from_numpy(h), torch.from_numpy(W), torch.from_numpy(targets),
                                  torch.from_numpy(temperature), vocab_chunk)
    ref_logp, ref_entropy = np_head(h, W, targets, temperature)
    np.testing.assert_allclose(logp.numpy(), ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy.numpy(), ref_entropy, rtol=1e-5, atol=1e-5)
    uniform = head_logprobs(torch.zeros(2, H), torch.from_numpy(W), torch.tensor([0, 1]), torch.ones(2), vocab_chunk)[1]
    np.testing.assert_allclose(uniform.numpy(), np.log(V), rtol=1e-6)


def test_chunked_head_gradient_matches_autograd():
    torch.manual_seed(4)
    M, H, V = 11, 6, 50
    h, W = torch.randn(M, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets, temperature = torch.randint(0, V, (M,)), torch.rand(M) + 0.5
    g_logp, g_entropy = torch.randn(M), torch.randn(M)
    logp, entropy = head_logprobs(h, W, targets, temperature, vocab_chunk=16)
    chunked = torch.autograd.grad((logp * g_logp + entropy * g_entropy).sum(), [h, W])
    ref = torch.log_softmax((h @ W.T) / temperature[:, None], -1)
    ref_logp, ref_entropy = ref.gather(1, targets[:, None]).squeeze(1), -(ref.exp() * ref).sum(-1)
    plain = torch.autograd.grad((ref_logp * g_logp + ref_entropy * g_entropy).sum(), [h, W])
    for got, want in zip(chunked, plain):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_masked_rows_are_scored_over_their_allowed_tokens_with_the_gradient_of_the_renormalised_softmax():
    """actor.constrain_actions: a row's log-prob and entropy are those of its distribution renormalised
    over the tokens the mask let through (one token: log-prob 0, no gradient), at its temperature."""
    torch.manual_seed(5)
    H, V = 6, 40
    sets = [[3, 5, 7], [1], [2, 9, 11, 4], [0, 39], [6, 8, 10, 12, 14]]
    h, W = torch.randn(len(sets), H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets, temperature = torch.tensor([5, 1, 4, 39, 14]), torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0])
    rows = torch.tensor([r for r, ids in enumerate(sets) for _ in ids])
    logp, entropy = masked_logprobs(h, W, targets, temperature, rows, torch.tensor([t for ids in sets for t in ids]))
    g_logp, g_entropy = torch.randn(len(sets)), torch.randn(len(sets))
    got = torch.autograd.grad((logp * g_logp + entropy * g_entropy).sum(), [h, W])
    ref = [torch.log_softmax(h[r] @ W[ids].T / temperature[r], 0) for r, ids in enumerate(sets)]
    ref_logp = torch.stack([lp[ids.index(int(targets[r]))] for r, (lp, ids) in enumerate(zip(ref, sets))])
    ref_entropy = torch.stack([-(lp.exp() * lp).sum() for lp in ref])
    want = torch.autograd.grad((ref_logp * g_logp + ref_entropy * g_entropy).sum(), [h, W])
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-5, atol=1e-6)
    assert logp[1] == 0 and entropy[1] == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    whole = head_logprobs(h.detach(), W.detach(), targets, temperature)[0]
    assert (logp.detach() - whole > 0.1).all()  # renormalised: more than the whole vocabulary gives
    # In chunks of 4 of the 15 pairs (each chunk's gathers recomputed in backward): the same numbers.
    chunked = masked_logprobs(h, W, targets, temperature, rows, torch.tensor([t for ids in sets for t in ids]), 4)
    torch.testing.assert_close(chunked[0], logp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chunked[1], entropy, rtol=1e-6, atol=1e-7)
    for g, w in zip(torch.autograd.grad((chunked[0] * g_logp + chunked[1] * g_entropy).sum(), [h, W]), got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def steps_of(x, mask):
    """Each row's masked positions, in order (the steps GAE and V-trace run over)."""
    return [x[i][mask[i] > 0] for i in range(len(x))]


def np_gae(r, v, gamma, lam):
    """One episode: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_L = 0."""
    L = len(r)
    v_next = np.append(v[1:], 0.0)
    delta = r + gamma * v_next - v
    return np.array([sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, L)) for t in range(L)])


def np_vtrace(r, v, rhos, gamma, lam, rho_bar, c_bar):
    """IMPALA's definition, as written: v_s = V_s + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t delta_t,
    and the policy-gradient advantage rho_s (r_s + gamma v_{s+1} - V_s)."""
    L = len(r)
    v_next = np.append(v[1:], 0.0)
    rho = np.minimum(rho_bar, rhos)
    c = lam * np.minimum(c_bar, rhos)
    delta = rho * (r + gamma * v_next - v)
    vs = np.array([v[s] + sum(gamma ** (t - s) * np.prod(c[s:t]) * delta[t] for t in range(s, L)) for s in range(L)])
    vs_next = np.append(vs[1:], 0.0)
    return vs, rho * (r + gamma * vs_next - v)


def episodes(seed, N=5, T=14):
    """Rows of generated steps with context between them; rewards at a few steps."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((N, T)) < 0.6).astype(np.float32)
    mask[0] = 0  # a row without steps
    mask[1, -1] = 1  # a row whose last position is a step
    rewards = np.where(rng.random((N, T)) < 0.3, rng.normal(0, 1, (N, T)), 0.0).astype(np.float32) * mask
    values = rng.normal(0, 1, (N, T)).astype(np.float32)
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0), (0.0, 0.7), (0.99, 1.0)])
def test_gae_matches_numpy(gamma, lam):
    rewards, values, mask = episodes(2)
    adv, ret = gae(*(torch.from_numpy(x) for x in (rewards, values, mask)), gamma, lam)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    for a, r, rr, vv in zip(steps_of(adv.numpy(), mask), steps_of(ret.numpy(), mask),
                            steps_of(rewards, mask), steps_of(values, mask)):
        want = np_gae(rr, vv, gamma, lam)
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r, want + vv, rtol=1e-5, atol=1e-5)
    if (gamma, lam) == (1.0, 1.0):  # Monte Carlo: the sum of the rewards to come, less V_t
        rr, vv = steps_of(rewards, mask)[1], steps_of(values, mask)[1]
        np.testing.assert_allclose(steps_of(adv.numpy(), mask)[1], np.cumsum(rr[::-1])[::-1] - vv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma,lam,rho_bar,c_bar", [(1.0, 1.0, 1.0, 1.0), (0.9, 0.95, 1.0, 1.0), (0.99, 1.0, 2.0, 1.5)])
def test_vtrace_matches_impala_definition(gamma, lam, rho_bar, c_bar):
    rewards, values, mask = episodes(3)
    log_rhos = np.random.default_rng(4).normal(0, 0.7, rewards.shape).astype(np.float32)
    adv, vs = vtrace(*(torch.from_numpy(x) for x in (rewards, values, log_rhos, mask)), gamma, lam, rho_bar, c_bar)
    assert torch.all(vs[mask == 0] == 0)
    rows = zip(steps_of(adv.numpy(), mask), steps_of(vs.numpy(), mask), steps_of(rewards, mask),
               steps_of(values, mask), steps_of(np.exp(log_rhos), mask))
    for a, v_s, rr, vv, rhos in rows:
        want_vs, want_pg = np_vtrace(rr, vv, rhos, gamma, lam, rho_bar, c_bar)
        np.testing.assert_allclose(v_s, want_vs, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.minimum(rho_bar, rhos) * a, want_pg, rtol=1e-4, atol=1e-5)


def test_vtrace_on_policy_is_gae_lambda():
    """With pi = mu (and bars at 1), V-trace's targets are GAE(lambda)'s returns."""
    rewards, values, mask = (torch.from_numpy(x) for x in episodes(5))
    adv_g, ret_g = gae(rewards, values, mask, 0.95, 0.9)
    adv_v, vs = vtrace(rewards, values, torch.zeros_like(rewards), mask, 0.95, 0.9)
    torch.testing.assert_close(vs, ret_g, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adv_v, adv_g)  # the advantage is one-step on v: q_t - V_t, not GAE's


def test_gigpo_groups_turns_by_anchor_state():
    """Three episodes of one group on a hand-made task; states a, b, c, d; gamma 0.5."""
    turn_rewards = [[0.0, 0.0, 1.0], [0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    states = [["a", "b", "c"], ["a", "c"], ["a", "b", "d", "b"]]
    returns = [discounted_returns(r, 0.5) for r in turn_rewards]
    assert returns == [[0.25, 0.5, 1.0], [0.5, 1.0], [0.0, 0.0, 0.0, 0.0]]
    got = gigpo_step_advantages(returns, states)
    # anchor a: returns 0.25, 0.5, 0 (mean 0.25, std 0.25); b: 0.5, 0, 0 (mean 1/6, std sqrt(1/12));
    # c: 1.0, 1.0 (equal: 0); d: alone (0)
    std_b = np.sqrt(1 / 12)
    want = [[0.0, (0.5 - 1 / 6) / std_b, 0.0], [1.0, 0.0], [-1.0, -1 / 6 / std_b, 0.0, -1 / 6 / std_b]]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    centered = gigpo_step_advantages(returns, states, scale_by_std=False)
    np.testing.assert_allclose(centered[2], [-0.25, -1 / 6, 0.0, -1 / 6], rtol=1e-6)


def test_kl_estimators():
    rng = np.random.default_rng(6)
    logits_p, logits_q = rng.normal(0, 1, 5), rng.normal(0, 1, 5)
    p, q = np.exp(logits_p) / np.exp(logits_p).sum(), np.exp(logits_q) / np.exp(logits_q).sum()
    exact = float((p * np.log(p / q)).sum())
    # Expectation under p of each estimator, computed exactly over the 5 outcomes.
    lp, lq = torch.tensor(np.log(p)), torch.tensor(np.log(q))
    for kind in ("k1", "k3"):
        assert float((torch.tensor(p) * kl_penalty(lp, lq, kind)).sum()) == pytest.approx(exact, rel=1e-9)
    assert torch.all(kl_penalty(lp, lq, "k3") >= 0) and torch.any(kl_penalty(lp, lq, "k1") < 0)
    with pytest.raises(ValueError, match="learner.kl_estimator"):
        kl_penalty(lp, lq, "k2")


def test_masked_scoring_in_chunks_keeps_no_pairs_by_hidden_size_tensor_for_backward():
    """The (P, H) gathers of the allowed rows are what the masked head's memory grows with; in
    chunks none is kept for backward (each is recomputed there), whole they are."""
    torch.manual_seed(6)
    M, H, V, per_row = 32, 512, 500, 50
    h, W = torch.randn(M, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    rows = torch.arange(M).repeat_interleave(per_row)
    ids = torch.randint(0, V, (M * per_row,))
    targets = ids[torch.arange(M) * per_row]
    inputs = {h.untyped_storage().data_ptr(), W.untyped_storage().data_ptr()}

    def kept_bytes(pair_chunk: int) -> int:
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = masked_logprobs(h, W, targets, torch.ones(M), rows, ids, pair_chunk)
        logp.sum().backward()
        return sum(kept.values())

    pairs_by_h = M * per_row * H * 4
    assert kept_bytes(10 ** 6) >= 2 * pairs_by_h  # whole: both gathers kept
    assert kept_bytes(256) < pairs_by_h / 16  # in chunks: the pairs' logits and indices only (P each)


def test_the_configs_lists_of_algorithms_are_the_learners():
    """common/config.py names the algorithms by kind for its checks (it may not import the learner);
    they must be the learner's registry: each estimator group-relative or not, and the critic's."""
    import typing

    from common.config import CRITIC_ALGORITHMS, GROUP_RELATIVE, LearnerConfig
    from learner.algorithms import ESTIMATORS

    # gigpo is grpo's estimator with step advantages added (learner/batch.py), not an estimator of its own
    assert set(typing.get_args(LearnerConfig.model_fields["algorithm"].annotation)) == {
        *ESTIMATORS, *CRITIC_ALGORITHMS, "gigpo"}
    assert {name for name, est in ESTIMATORS.items() if est.group_relative} | {"gigpo"} == set(GROUP_RELATIVE)
    assert not set(CRITIC_ALGORITHMS) & set(GROUP_RELATIVE)
