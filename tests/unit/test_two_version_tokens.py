"""Responses whose tokens were sampled by two policy versions (partial rollouts, issue 35).

A partial rollout that spans a weight sync holds tokens sampled by version v (before the sync) and by v+1
(after), each with its own behaviour log-prob. The objective must weigh every token by its own
pi_old / pi_behaviour and clip its own pi_theta / pi_old, so tokens of the two versions never mix. Hand-built
cases through the registered objective, with the algorithm config that runs when producers lag
(``GRPO`` resolved with ``n_behind > 0``: truncated IS cap 2, pi_old recomputed), and the properties that
make a response's segments independent.
"""

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.config import replace
from colossal_rl.presets import algorithm_preset
from colossal_rl.training.objective import objective_for

LENGTH = 4
VERSION_V = slice(0, 2)  # tokens 0-1 sampled before the weight sync
VERSION_V1 = slice(2, 4)  # tokens 2-3 sampled after it

ADVANTAGE = 0.5
OLD = [-1.0, -2.0, -0.5, -1.5]  # pi_old: the trainer's policy at the start of the round
BEHAVIOUR = [-2.5, -2.4, -0.3, -1.6]  # tokens 0-1 from version v, tokens 2-3 from version v+1
NEW = [-0.9, -1.7, -0.25, -1.8]  # pi_theta


def _lagging_grpo(preset="GRPO"):
    """The preset as resolved for a run whose producers may lag one version (what ``resolve`` makes of it)."""
    return algorithm_preset(preset, kl_coeff=0.0, max_new_tokens=LENGTH, n_behind=1)


def _loss_and_grad(algo, *, new, old, behaviour, response_mask=None, global_token_count=float(LENGTH)):
    """The registered objective's loss and its gradient w.r.t. new_logprobs, for one response [1, LENGTH]."""
    new_logprobs = torch.tensor([new]).requires_grad_()
    loss, metrics = objective_for(algo).loss(
        new_logprobs=new_logprobs,
        old_logprobs=torch.tensor([old]),
        behaviour_logprobs=torch.tensor([behaviour]),
        ref_logprobs=None,
        advantages=torch.tensor([ADVANTAGE]),
        response_mask=torch.ones(1, LENGTH) if response_mask is None else response_mask,
        loss_mask=torch.ones(1),
        algo=algo,
        global_token_count=global_token_count,
        global_sample_count=1.0,
        max_response_length=LENGTH,
        group_size=1,
    )
    loss.backward()
    return loss.detach(), new_logprobs.grad, metrics


def test_a_lagging_producer_selects_truncated_is_with_recomputed_old_logprobs():
    algo = _lagging_grpo()
    assert (algo.objective, algo.policy_loss, algo.loss_aggregation) == ("policy_gradient", "clipped", "sample_level")
    assert (algo.clip_eps_low, algo.clip_eps_high, algo.truncated_is_cap) == (0.2, 0.2, 2.0)
    assert algo.old_logprobs == "recompute"
    in_step = algorithm_preset("GRPO", kl_coeff=0.0, max_new_tokens=LENGTH, n_behind=0)
    assert in_step.truncated_is_cap is None


def test_hand_computed_two_version_response():
    loss, grad, metrics = _loss_and_grad(_lagging_grpo(), new=NEW, old=OLD, behaviour=BEHAVIOUR)
    # truncated IS weight w_t = min(exp(old_t - behaviour_t), 2), per token:
    #   log-ratios [1.5, 0.4 | -0.2, 0.1] -> exp [4.4816891, 1.4918247 | 0.8187308, 1.1051709]
    weights = [2.0, 1.4918247, 0.8187308, 1.1051709]  # token 0 (version v) is capped at 2
    # PPO ratio r_t = exp(new_t - old_t): log-ratios [0.1, 0.3 | 0.25, -0.3]
    ratios = [1.1051709, 1.3498588, 1.2840254, 0.7408182]
    # l_t = max(-A r_t, -A clip(r_t, 0.8, 1.2)), A = 0.5: tokens 1 and 2 (one per version) clip at 1.2;
    # token 3's r < 0.8 does not clip with A > 0
    token_losses = [-0.5525855, -0.6, -0.6, -0.3704091]
    # w_t l_t = [-1.1051709, -0.8950948 | -0.4912385, -0.4093654]; GRPO: mean over the response's 4 tokens
    expected_loss = (-1.1051709 - 0.8950948 - 0.4912385 - 0.4093654) / 4  # = -0.7252174
    # d loss / d new_t = -w_t A r_t / 4 where unclipped, 0 where clipped (the weight is detached)
    expected_grad = [
        -2.0 * 0.5 * 1.1051709 / 4,
        0.0,
        0.0,
        -1.1051709 * 0.5 * 0.7408182 / 4,
    ]  # [-0.2762927, 0, 0, -0.1023413]
    assert_close(loss, torch.tensor(expected_loss))
    assert_close(grad, torch.tensor([expected_grad]))
    # the hand pieces agree: w_t * l_t are the terms of expected_loss
    assert_close(
        torch.tensor(weights) * torch.tensor(token_losses),
        torch.tensor([-1.1051709, -0.8950948, -0.4912385, -0.4093654]),
    )
    assert_close(metrics["train/ratio_mean"], torch.tensor(sum(ratios) / 4))
    assert_close(metrics["train/clip_fraction"], torch.tensor(0.5))
    assert_close(metrics["off_policy/tis_weight_mean"], torch.tensor(sum(weights) / 4))
    assert_close(metrics["off_policy/capped_fraction"], torch.tensor(0.25))


def test_hand_computed_two_version_response_on_the_rounds_first_step():
    # the round's first step takes pi_old = its own forward, detached (training/step_loss.py): r_t = 1, so
    # no token clips, and w_t = min(exp(new_t - behaviour_t), 2)
    loss, grad, _ = _loss_and_grad(_lagging_grpo(), new=NEW, old=NEW, behaviour=BEHAVIOUR)
    # log-ratios new - behaviour [1.6, 0.7 | 0.05, -0.2] -> exp [4.9530324, 2.0137527 | 1.0512711, 0.8187308]
    weights = [2.0, 2.0, 1.0512711, 0.8187308]  # both version-v tokens capped
    # l_t = -A w_t, A = 0.5; mean over 4 tokens; d loss / d new_t = -A w_t / 4
    assert_close(loss, torch.tensor(-0.5 * (2.0 + 2.0 + 1.0512711 + 0.8187308) / 4))  # = -0.7337502
    assert_close(grad, torch.tensor([[-0.5 * w / 4 for w in weights]]))  # [-0.25, -0.25, -0.1314089, -0.1023413]


@pytest.mark.parametrize("preset", ["GRPO", "DAPO"])
def test_version_segments_sum_to_the_whole_response(preset):
    algo = _lagging_grpo(preset)
    whole_loss, whole_grad, _ = _loss_and_grad(algo, new=NEW, old=OLD, behaviour=BEHAVIOUR)
    # Each segment alone, over the whole response's token count. GRPO's per-sample mean divides by the
    # sample's own masked-in tokens, so a segment masked out of the response would divide by 2, not 4;
    # token_level with global_token_count 4 is that per-sample mean for this one-response batch.
    segment_algo = replace(algo, loss_aggregation="token_level")
    losses, grads = [], []
    for segment in (VERSION_V, VERSION_V1):
        response_mask = torch.zeros(1, LENGTH)
        response_mask[:, segment] = 1.0
        loss, grad, _ = _loss_and_grad(segment_algo, new=NEW, old=OLD, behaviour=BEHAVIOUR, response_mask=response_mask)
        assert torch.all(grad[response_mask == 0] == 0)
        losses.append(loss)
        grads.append(grad)
    assert_close(losses[0] + losses[1], whole_loss)
    assert_close(grads[0] + grads[1], whole_grad)


@pytest.mark.parametrize(
    ("preset", "new"),
    [
        ("GRPO", NEW),
        ("DAPO", NEW),
        # GSPO clips the sequence ratio at 1 + 4e-4: mean log-ratio (0.1 + 0.3 + 0.25 - 0.7) / 4 < 0 stays inside
        ("GSPO", [-0.9, -1.7, -0.25, -2.2]),
    ],
)
def test_a_tokens_behaviour_logprob_moves_only_its_own_gradient(preset, new):
    # behaviour log-probs enter only through w_t = min(exp(old_t - behaviour_t), cap), one token's: for every
    # registered policy loss (GSPO's sequence ratio and DAPO's skip threshold read pi_old, not pi_behaviour)
    algo = _lagging_grpo(preset)
    loss, grad, _ = _loss_and_grad(algo, new=new, old=OLD, behaviour=BEHAVIOUR)
    moved = list(BEHAVIOUR)
    moved[3] = -1.9  # token 3's weight: exp(-1.5 + 1.6) = 1.1051709 -> exp(-1.5 + 1.9) = 1.4918247
    moved_loss, moved_grad, _ = _loss_and_grad(algo, new=new, old=OLD, behaviour=moved)
    assert grad[0, 3] != 0
    assert_close(moved_grad[:, :3], grad[:, :3], rtol=0, atol=0)
    assert_close(moved_grad[:, 3], grad[:, 3] * (1.4918247 / 1.1051709))
    assert not torch.equal(moved_loss, loss)


def test_gspo_with_behaviour_as_pi_old_mixes_the_versions_in_one_sequence_ratio():
    # By design, not per token: with --old-logprobs behaviour, pi_old = pi_behaviour, and GSPO's ratio
    # s = exp(mean_t(new_t - behaviour_t)) averages the log-ratios of both versions' tokens. That is the
    # sequence ratio against the process that sampled the response, mu(y) = prod_t pi_{v(t)}(y_t | y_<t),
    # so token 3's behaviour log-prob moves every token's gradient. (GRPO's clipped loss stays per token.)
    algo = replace(_lagging_grpo("GSPO"), old_logprobs="behaviour")
    new = [-2.6, -2.5, -0.4, -1.7]  # behaviour - 0.1: s = exp(-0.1) < 1, inside GSPO's clip with A > 0
    _, grad, _ = _loss_and_grad(algo, new=new, old=BEHAVIOUR, behaviour=BEHAVIOUR)
    moved = list(BEHAVIOUR)
    moved[3] = -1.9  # s = exp((-0.1 * 3 + 0.2) / 4) = exp(-0.025)
    _, moved_grad, _ = _loss_and_grad(algo, new=new, old=moved, behaviour=moved)
    # every token's gradient is -A s / 4 (w_t = 1 when pi_old is pi_behaviour)
    assert_close(grad, torch.full((1, LENGTH), -0.5 * 0.9048374 / 4))
    assert_close(moved_grad, torch.full((1, LENGTH), -0.5 * 0.9753099 / 4))
