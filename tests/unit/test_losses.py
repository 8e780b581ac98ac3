"""Policy losses, aggregations and KL estimators: hand-computed cases and properties."""

import math

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    clipped_policy_loss,
    gspo_policy_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    sample_level_loss,
    seq_mean_token_sum_loss,
    skip_threshold_mask,
    token_level_loss,
)

CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}


def _logprobs_with_ratios(ratios):
    """(new, old) with exp(new - old) = ratios, old fixed at -1."""
    ratios = torch.tensor(ratios, dtype=torch.float32)
    old = torch.full_like(ratios, -1.0)
    return (old + ratios.log()).requires_grad_(), old


def test_clipped_loss_hand_computed():
    new, old = _logprobs_with_ratios([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    advantages = torch.tensor([1.0, -1.0])
    out = clipped_policy_loss(new, old, advantages, torch.ones(2, 3), **CLIP)
    # A = +1: -min(r, clip(r, 0.8, 1.28));  A = -1: max(r, clip(r, 0.8, 1.28))
    assert_close(out.loss, torch.tensor([[-1.28, -0.5, -1.1], [1.5, 0.8, 1.1]]))
    assert out.clipped.tolist() == [[True, False, False], [False, True, False]]
    assert_close(out.ratio, torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]]))
    out.loss.sum().backward()
    # clipped tokens give no gradient; elsewhere d(-A r)/d logp_new = -A r
    assert_close(new.grad, torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 1.1]]))


def test_dual_clip_caps_negative_advantage_loss():
    new, old = _logprobs_with_ratios([[5.0, 1.0], [5.0, 1.0]])
    out = clipped_policy_loss(new, old, torch.tensor([-2.0, 2.0]), torch.ones(2, 2), **CLIP, dual_clip=3.0)
    # A = -2, r = 5: max(10, 2.56) = 10 > c|A| = 6 -> 6.  A = +2 is untouched by the dual clip.
    assert_close(out.loss, torch.tensor([[6.0, 2.0], [-2.56, -2.0]]))
    assert out.clipped.tolist() == [[True, False], [True, False]]
    out.loss.sum().backward()
    assert new.grad[0, 0] == 0


def test_lower_and_upper_clip_bounds_act_separately():
    old = torch.zeros(2, 1)
    up, down = old + 0.3, old - 0.3  # ratios 1.35 and 0.74
    for high, expected in ((0.2, -1.2), (0.28, -1.28)):
        loss = clipped_policy_loss(up, old, torch.ones(2), torch.ones(2, 1), clip_eps_low=0.2, clip_eps_high=high)
        assert_close(loss.loss, torch.full((2, 1), expected))
    for low, expected in ((0.2, 0.8), (0.1, 0.9)):
        loss = clipped_policy_loss(down, old, -torch.ones(2), torch.ones(2, 1), clip_eps_low=low, clip_eps_high=0.28)
        assert_close(loss.loss, torch.full((2, 1), expected))


def _lengths_mask(lengths, length):
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_ratio_one_gives_minus_mean_advantage():
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = _lengths_mask([1, 4, 2, 3], 4)
    logprobs = torch.randn(4, 4)
    for name in POLICY_LOSSES.names():
        per_token = POLICY_LOSSES.get(name)(logprobs, logprobs, advantages, mask, **CLIP).loss
        counts = {"global_token_count": 10.0, "global_sample_count": 4.0, "max_response_length": 8}
        assert_close(sample_level_loss(per_token, mask, **counts), -advantages.mean())
        assert_close(token_level_loss(per_token, mask, **counts), -(advantages * mask.sum(-1)).sum() / 10)
        assert_close(seq_mean_token_sum_loss(per_token, mask, **counts), -(advantages * mask.sum(-1)).sum() / 8 / 4)


def test_aggregations_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    counts = {"global_token_count": 6.0, "global_sample_count": 4.0, "max_response_length": 5}
    assert_close(token_level_loss(per_token, mask, **counts), torch.tensor(6.0 / 6))
    assert_close(sample_level_loss(per_token, mask, **counts), torch.tensor((1.5 + 3.0) / 4))
    assert_close(seq_mean_token_sum_loss(per_token, mask, **counts), torch.tensor((3.0 / 5 + 3.0 / 5) / 4))


def test_aggregations_of_an_empty_mask_are_zero():
    per_token = torch.randn(2, 3)
    counts = {"global_token_count": 0.0, "global_sample_count": 0.0, "max_response_length": 3}
    for name in LOSS_AGGREGATIONS.names():
        assert LOSS_AGGREGATIONS.get(name)(per_token, torch.zeros(2, 3), **counts) == 0


def _random_problem(seed, batch=8, length=6):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=generator) * 3
    new = old + torch.randn(batch, length, generator=generator) * 0.3
    advantages = torch.randn(batch, generator=generator)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return new, old, advantages, mask


@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("pieces", [[8], [4, 4], [3, 1, 4], [2, 2, 2, 2]])
def test_splitting_the_batch_with_global_counts_reproduces_loss_and_gradient(loss_name, aggregation, pieces):
    new, old, advantages, mask = _random_problem(seed=1)
    counts = {
        "global_token_count": float(mask.sum()),
        "global_sample_count": float(new.shape[0]),
        "max_response_length": 6,
    }
    loss_fn, aggregate = POLICY_LOSSES.get(loss_name), LOSS_AGGREGATIONS.get(aggregation)

    def piece_loss(leaf, rows):
        out = loss_fn(leaf[rows], old[rows], advantages[rows], mask[rows], clip_eps_low=0.1, clip_eps_high=0.2)
        return aggregate(out.loss, mask[rows], **counts)

    full_leaf = new.clone().requires_grad_()
    full = piece_loss(full_leaf, slice(None))
    full.backward()
    split_leaf = new.clone().requires_grad_()
    total, start = 0.0, 0
    for size in pieces:  # each piece stands for one micro-batch on one data-parallel rank
        part = piece_loss(split_leaf, slice(start, start + size))
        part.backward()
        total, start = total + part, start + size
    assert_close(total, full)
    assert_close(split_leaf.grad, full_leaf.grad)


@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS.names())
def test_masked_tokens_get_zero_gradient_even_with_garbage(loss_name, aggregation):
    new, old, advantages, mask = _random_problem(seed=2)
    new = torch.where(mask.bool(), new, 50.0).requires_grad_()  # padding logprobs far off the old ones
    out = POLICY_LOSSES.get(loss_name)(new, old, advantages, mask, **CLIP, dual_clip=3.0)
    loss = LOSS_AGGREGATIONS.get(aggregation)(
        out.loss, mask, global_token_count=float(mask.sum()), global_sample_count=8.0, max_response_length=6
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert torch.all(new.grad[mask == 0] == 0)
    assert torch.any(new.grad[mask == 1] != 0)


def test_gspo_clips_the_geometric_mean_ratio_per_sequence():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.3, 9.0], [1e-4, -1e-4, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = gspo_policy_loss(new, old, torch.tensor([1.0, 1.0]), mask, clip_eps_low=3e-4, clip_eps_high=4e-4)
    # sample 0: s = exp((0.1 + 0.3) / 2) = exp(0.2) > 1.0004 -> clipped; sample 1: s = 1 -> -1, unclipped
    assert_close(out.ratio[0], torch.full((3,), math.exp(0.2)))
    assert_close(out.loss, torch.tensor([[-1.0004] * 3, [-1.0] * 3]))
    assert out.clipped.tolist() == [[True] * 3, [False] * 3]


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
    new, old, advantages, mask = _random_problem(seed=3)
    new = (old + (new - old) * 0.01).detach()  # keep some sequences inside the tiny clip range
    counts = {"global_token_count": float(mask.sum()), "global_sample_count": 8.0, "max_response_length": 6}
    clip = {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}

    token_leaf = new.clone().requires_grad_()
    out = gspo_policy_loss(token_leaf, old, advantages, mask, **clip)
    sample_level_loss(out.loss, mask, **counts).backward()

    sequence_leaf = new.clone().requires_grad_()
    ratio = (((sequence_leaf - old) * mask).sum(-1) / mask.sum(-1)).exp()  # s_i  [B]
    clipped_ratio = ratio.clamp(1 - 3e-4, 1 + 4e-4)
    sequence_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio).mean()
    sequence_loss.backward()

    assert 0 < out.clipped[:, 0].sum() < 8
    assert_close(sample_level_loss(out.loss, mask, **counts), sequence_loss)
    assert_close(token_leaf.grad, sequence_leaf.grad)


def test_skip_threshold_mask_uses_the_mean_token_ratio():
    old = torch.zeros(2, 2)
    new = torch.tensor([[math.log(30.0), 0.0], [math.log(49.0), math.log(1.0)]])
    mask = torch.ones(2, 2)
    # mean ratios 15.5 and 25
    assert skip_threshold_mask(new, old, mask, 20.0).tolist() == [True, False]
    # a masked-out huge ratio does not count
    assert skip_threshold_mask(new, old, torch.tensor([[1.0, 1.0], [0.0, 1.0]]), 20.0).tolist() == [True, True]


def test_kl_estimators_hand_computed():
    logprobs, ref_logprobs = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -2.0]])
    assert_close(kl_k1(logprobs, ref_logprobs), torch.tensor([[1.0, 0.0]]))
    assert_close(kl_k2(logprobs, ref_logprobs), torch.tensor([[0.5, 0.0]]))
    assert_close(kl_k3(logprobs, ref_logprobs), torch.tensor([[math.exp(-1.0) + 1.0 - 1.0, 0.0]]))


def test_k3_clamps_the_log_ratio_on_both_sides():
    # log ratio (ref - logp) of +-1000 is clamped to +-20 before exp: finite, and the documented value
    logprobs, ref_logprobs = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1000.0, -1000.0, -19.0])
    expected = [math.exp(20.0) - 20.0 - 1.0, math.exp(-20.0) + 20.0 - 1.0, math.exp(-19.0) + 19.0 - 1.0]
    assert_close(kl_k3(logprobs, ref_logprobs), torch.tensor(expected))


@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
def test_policy_loss_ratios_are_clamped_on_both_sides(loss_name):
    # one-token responses, so the sequence ratio (GSPO) is the token ratio: log ratios +-50 -> exp(+-20); +-19 kept
    old = torch.zeros(4, 1)
    new = torch.tensor([[50.0], [-50.0], [19.0], [-19.0]])
    out = POLICY_LOSSES.get(loss_name)(new, old, torch.ones(4), torch.ones(4, 1), **CLIP)
    assert_close(out.ratio, torch.tensor([[20.0], [-20.0], [19.0], [-19.0]]).exp())


def test_kl_estimators_are_unbiased_or_nonnegative():
    # samples x ~ p of two categoricals: k1 and k3 average to KL(p || q); k2 and k3 are never negative
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, ref_logprobs = p.log()[samples], q.log()[samples]
    true_kl = (p * (p / q).log()).sum()
    assert_close(kl_k1(logprobs, ref_logprobs).mean(), true_kl, atol=5e-3, rtol=0)
    assert_close(kl_k3(logprobs, ref_logprobs).mean(), true_kl, atol=5e-3, rtol=0)
    for name in ("k2", "k3"):
        assert (KL_ESTIMATORS.get(name)(torch.randn(100), torch.randn(100)) >= 0).all()
