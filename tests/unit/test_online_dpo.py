"""Online DPO: the pairing of a group's samples, the DPO loss against hand-computed values, and the objective's
global scaling (micro-batches and ranks sum to the full-batch loss)."""

import math

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS, dpo_loss, preference_pair_signs
from colossal_rl.batch import RolloutBatch
from colossal_rl.config import OBJECTIVE_NAMES, AlgorithmConfig, ConfigError, replace
from colossal_rl.presets import algorithm_preset
from colossal_rl.rollout.postprocess import postprocess_rollout
from colossal_rl.training.objective import OBJECTIVES, dpo_objective, objective_for

DPO = algorithm_preset("ONLINE_DPO", kl_coeff=0.0, max_new_tokens=4, n_behind=1)


def test_pairs_take_the_first_best_and_the_first_worst_sample_of_each_group():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 0.2, 0.9, 0.2])
    assert preference_pair_signs(rewards, 4).tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, -1.0, 1.0, 0.0]


def test_ties_and_all_equal_groups_get_no_pair():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3])
    assert preference_pair_signs(rewards, 3).tolist() == [0.0] * 9


def test_invalid_samples_never_enter_a_pair():
    rewards = torch.tensor([5.0, 1.0, 0.0, -3.0, 2.0, 2.0])
    valid = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    # group 0: the 5.0 and -3.0 are invalid -> pair (1.0, 0.0); group 1: one valid sample -> no pair
    assert preference_pair_signs(rewards, 3, valid_mask=valid).tolist() == [0.0, 1.0, -1.0, 0.0, 0.0, 0.0]


def test_pairing_is_the_dpo_pairs_estimator():
    assert ADVANTAGE_ESTIMATORS.get("dpo_pairs") is preference_pair_signs


def test_dpo_loss_hand_computed():
    # beta (0.5 - (-1.5)) = 0.2 * 2 = 0.4 -> -log sigmoid(0.4) = log(1 + e^-0.4)
    loss = dpo_loss(torch.tensor([0.5]), torch.tensor([-1.5]), beta=0.2)
    assert_close(loss, torch.tensor([math.log(1 + math.exp(-0.4))]))


def _pair_problem():
    """Two groups of 3 samples with 2 response tokens; group 0 pairs (chosen 1, rejected 0); group 1 none."""
    new = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -3.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    signs = torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    return new, ref, mask, signs


def test_objective_hand_computed_loss_gradient_and_metrics():
    new, ref, mask, signs = _pair_problem()
    new = new.clone().requires_grad_()
    loss, metrics = dpo_objective(
        new_logprobs=new,
        ref_logprobs=ref,
        advantages=signs,
        response_mask=mask,
        loss_mask=(signs != 0).float(),
        algo=replace(DPO, dpo_beta=0.5),
        global_token_count=4.0,
        global_sample_count=2.0,
        max_response_length=2,
        group_size=3,
    )
    # chosen (sample 1, second token masked): -0.5 - (-1.0) = 0.5; rejected (sample 0): (-3) - (-2.5) = -0.5
    # margin 1.0, beta 0.5 -> -log sigmoid(0.5)
    expected = math.log(1 + math.exp(-0.5))
    assert_close(loss, torch.tensor(expected))
    loss.backward()
    weight = 0.5 * (1 - 1 / (1 + math.exp(-0.5)))  # beta * sigmoid(-z)
    expected_grad = torch.zeros(6, 2)
    expected_grad[1, 0] = -weight  # raise the chosen response's tokens
    expected_grad[0] = weight  # lower the rejected's
    assert_close(new.grad, expected_grad)
    assert_close(metrics["train/dpo_accuracy"], torch.tensor(1.0))
    assert_close(metrics["train/dpo_margin"], torch.tensor(1.0))
    assert_close(metrics["train/dpo_chosen_log_ratio"], torch.tensor(0.5))


def test_objective_sums_over_micro_batches_and_ranks_to_the_full_batch_mean():
    generator = torch.Generator().manual_seed(3)
    groups, size, length = 6, 4, 5
    new = -torch.rand(groups * size, length, generator=generator) * 2
    ref = new + torch.randn(groups * size, length, generator=generator) * 0.3
    mask = (torch.rand(groups * size, length, generator=generator) > 0.2).float()
    rewards = torch.randint(0, 3, (groups * size,), generator=generator).float()
    rewards[:size] = 1.0  # one all-equal group: no pair
    signs = preference_pair_signs(rewards, size)
    loss_mask = (signs != 0).float()
    pairs = int(loss_mask.sum()) // 2
    assert 0 < pairs < groups

    def run(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        part = new[rows].clone().requires_grad_()
        loss, _ = dpo_objective(
            new_logprobs=part,
            ref_logprobs=ref[rows],
            advantages=signs[rows],
            response_mask=mask[rows],
            loss_mask=loss_mask[rows],
            algo=DPO,
            global_token_count=1.0,
            global_sample_count=float(loss_mask.sum()),
            max_response_length=length,
            group_size=size,
        )
        loss.backward()
        return loss.detach(), part.grad

    full_loss, full_grad = run(slice(None))
    parts = [run(slice(start, start + 2 * size)) for start in range(0, groups * size, 2 * size)]
    assert_close(sum(loss for loss, _ in parts), full_loss)
    assert_close(torch.cat([grad for _, grad in parts]), full_grad)
    chosen = (new - ref).mul(mask).sum(-1)[signs > 0]
    rejected = (new - ref).mul(mask).sum(-1)[signs < 0]
    assert_close(full_loss, dpo_loss(chosen, rejected, DPO.dpo_beta).mean())


def test_a_split_group_is_refused():
    new, ref, mask, signs = _pair_problem()
    with pytest.raises(ValueError, match="whole groups of 3"):
        dpo_objective(
            new_logprobs=new[:4],
            ref_logprobs=ref[:4],
            advantages=signs[:4],
            response_mask=mask[:4],
            loss_mask=torch.ones(4),
            algo=DPO,
            global_token_count=1.0,
            global_sample_count=2.0,
            max_response_length=2,
            group_size=3,
        )


def test_postprocess_marks_the_pair_and_masks_every_other_sample():
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    batch = RolloutBatch(
        prompt_ids=torch.ones(8, 3, dtype=torch.long),
        prompt_mask=torch.ones(8, 3, dtype=torch.long),
        response_ids=torch.ones(8, 2, dtype=torch.long),
        response_mask=torch.ones(8, 2, dtype=torch.long),
        behaviour_logprobs=torch.zeros(8, 2),
        rewards=rewards,
        answer_correct=rewards.bool(),
        truncated=torch.zeros(8, dtype=torch.bool),
        loss_mask=torch.ones(8),
        group_size=4,
        policy_version=0,
    )
    processed, metrics = postprocess_rollout(batch, DPO, max_new_tokens=2)
    assert processed.advantages.tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert processed.loss_mask.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert metrics["rollout/zero_advantage_masked_fraction"] == 6 / 8


def test_objective_names_match_the_registry_and_what_each_needs():
    assert tuple(OBJECTIVES.names()) == tuple(sorted(OBJECTIVE_NAMES))
    dpo, pg = objective_for(DPO), objective_for(AlgorithmConfig())
    assert (dpo.whole_groups, dpo.needs_reference, dpo.uses_old_logprobs) == (True, True, False)
    assert (pg.whole_groups, pg.needs_reference, pg.uses_old_logprobs) == (False, False, True)


def test_dpo_without_its_pairing_is_refused():
    with pytest.raises(ConfigError, match="dpo_pairs"):
        replace(DPO, mask_zero_advantage=False).validate()
    with pytest.raises(ConfigError, match="dpo_pairs"):
        replace(DPO, advantage_estimator="grpo").validate()
    with pytest.raises(ConfigError, match="algorithm.objective"):
        replace(DPO, objective="ppo_critic").validate()


@pytest.mark.parametrize("layout", ["shared_prompt", "padded", "packed"])
def test_a_real_trainer_step_starts_at_log_2_and_separates_the_pair(layout):
    """At step 0 the policy is the reference, so every pair's loss is log 2; micro-batches of 3 samples are
    widened to whole groups of 4, and a few steps raise the chosen responses over the rejected ones."""
    from trainer_harness import make_batch, make_config, make_trainer

    from colossal_rl.rollout.postprocess import postprocess_rollout

    config = make_config(algorithm=DPO, train={"microbatch_size": 3, "sequence_layout": layout})
    trainer = make_trainer(config)
    assert trainer.reference_model is not None
    batch, _ = postprocess_rollout(make_batch(num_groups=4), DPO, max_new_tokens=5)
    pairs = int(batch.loss_mask.sum()) // 2
    assert pairs >= 2
    assert trainer.micro_forward.micro_ranges(batch, same_count_on_every_rank=False)[0] == (0, 4)
    first = trainer.train_step(batch)
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert first["train/dpo_margin"] == pytest.approx(0.0, abs=1e-5)
    for _ in range(3):
        last = trainer.train_step(batch)
    assert last["train/loss"] < math.log(2) - 0.05
    assert last["train/dpo_margin"] > 0.5
    assert last["train/dpo_accuracy"] == 1.0
