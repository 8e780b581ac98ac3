"""pi_old in the trainer: the trust region acts.

Hand-computed cases go through ``StepLoss`` — the call the training step makes per micro-batch — with a
batch whose ``old_logprobs`` differ from the new ones; each would fail if pi_old were the new log-probs
detached (ratio 1: nothing clips). The round-level tests run a real trainer (world size 1, gloo).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_harness import make_batch, make_config, make_trainer

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig, replace
from colossal_rl.presets import algorithm_preset
from colossal_rl.training.objective import objective_for
from colossal_rl.training.round_plan import epoch_permutation, epoch_steps
from colossal_rl.training.step_loss import StepCounts, StepLoss, StepTotals


def _micro(new: torch.Tensor, old: torch.Tensor, advantages: list[float]) -> RolloutBatch:
    n, t = new.shape
    return RolloutBatch(
        prompt_ids=torch.zeros(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.long),
        response_ids=torch.zeros(n, t, dtype=torch.long),
        response_mask=torch.ones(n, t, dtype=torch.long),
        behaviour_logprobs=old.clone(),
        rewards=torch.zeros(n),
        answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.tensor(advantages),
        old_logprobs=old,
        group_size=1,
        policy_version=0,
    )


def _loss_and_grad(algorithm: AlgorithmConfig, new_values, old_values, advantages):
    new = torch.tensor(new_values, dtype=torch.float64).log().requires_grad_()
    old = torch.tensor(old_values, dtype=torch.float64).log()
    micro = _micro(new.detach(), old, advantages)
    tokens = float(micro.response_mask.sum())
    totals = StepTotals()
    step_loss = StepLoss(
        objective=objective_for(algorithm),
        algorithm=algorithm,
        max_response_length=make_config().generation.max_new_tokens,
        counts=StepCounts(trained_tokens=tokens, loss_samples=float(micro.num_samples)),
        step_samples=micro.num_samples,
    )
    loss = step_loss(new, torch.zeros_like(new), micro, 0, micro.num_samples, None, totals)
    loss.backward()
    return float(loss), new.grad, totals.values


GRPO = algorithm_preset("GRPO", kl_coeff=0.0, max_new_tokens=8, n_behind=0)


def test_a_token_outside_the_clip_range_gives_no_gradient():
    # Ratios 1, 1.25 (> 1 + 0.2 with A > 0: clipped), 0.5 / 0.45 = 1.111 (inside). sample_level over 3 tokens:
    # d loss / d logp_t = -A r_t / 3 for unclipped tokens, 0 for the clipped one.
    loss, grad, totals = _loss_and_grad(GRPO, [[0.5, 0.5, 0.5]], [[0.5, 0.4, 0.45]], [1.0])
    assert grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -(0.5 / 0.45) / 3])
    assert loss == pytest.approx(-(1 + 1.2 + 0.5 / 0.45) / 3)
    assert totals["train/clip_fraction"] == pytest.approx(1 / 3)
    assert totals["train/clip_fraction_high"] == pytest.approx(1 / 3)
    assert totals["train/clip_fraction_low"] == 0.0
    assert totals["train/ratio_max"] == pytest.approx(1.25)


def test_the_lower_clip_bites_for_negative_advantages():
    # Ratio 0.5 / 0.8 = 0.625 < 0.8 with A = -1: clipped at -A * 0.8, no gradient; ratio 1: gradient -A / 2.
    loss, grad, totals = _loss_and_grad(GRPO, [[0.5, 0.5]], [[0.8, 0.5]], [-1.0])
    assert grad[0].tolist() == pytest.approx([0.0, 0.5])
    assert loss == pytest.approx((0.8 + 1.0) / 2)
    assert totals["train/clip_fraction_low"] == pytest.approx(0.5)


def test_dual_clip_bounds_a_negative_advantage_token():
    algorithm = replace(GRPO, dual_clip=3.0)
    # Ratio 4 > c = 3 with A = -1: loss max(4, 1.2) = 4 is capped at c * |A| = 3, constant: no gradient.
    loss, grad, totals = _loss_and_grad(algorithm, [[0.8]], [[0.2]], [-1.0])
    assert loss == pytest.approx(3.0)
    assert grad[0].tolist() == [0.0]
    assert totals["train/dual_clip_fraction"] == 1.0


def test_gspo_clips_the_sequence_ratio():
    gspo = algorithm_preset("GSPO", kl_coeff=0.0, max_new_tokens=8, n_behind=0)
    # Token ratios 1.002 and 1.0: sequence ratio sqrt(1.002) = 1.000999... > 1 + 4e-4 with A > 0: clipped for
    # every token, loss -A (1 + 4e-4), no gradient. The second sample (ratio 1) is unclipped: gradient -A / 2.
    loss, grad, totals = _loss_and_grad(gspo, [[0.501, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]], [1.0, 1.0])
    assert grad[0].tolist() == [0.0, 0.0]
    assert grad[1].tolist() == pytest.approx([-0.25, -0.25])
    assert loss == pytest.approx((-(1 + 4e-4) - 1.0) / 2)
    assert totals["train/clip_fraction"] == pytest.approx(0.5)


def test_skip_threshold_drops_a_runaway_sample():
    dapo = algorithm_preset("DAPO", kl_coeff=0.0, max_new_tokens=8, n_behind=0)
    # Sample 0's mean token ratio is 25 > skip_threshold 20: out of the loss (no gradient); sample 1 stays.
    loss, grad, totals = _loss_and_grad(dapo, [[0.5, 0.5], [0.5, 0.5]], [[0.02, 0.02], [0.5, 0.5]], [1.0, 1.0])
    assert grad[0].tolist() == [0.0, 0.0]
    assert grad[1].tolist() == pytest.approx([-0.25, -0.25])  # token_level over 4 global tokens
    assert totals["train/skipped_fraction"] == pytest.approx(0.5)
    assert loss == pytest.approx(-2 / 4)


# --------------------------------------------------------------------------- a real trainer, whole rounds
def _ratio_and_clip(metrics: list[tuple[dict, RolloutBatch]]) -> list[tuple[float, float]]:
    return [(m["train/ratio_mean"], m["train/clip_fraction"]) for m, _ in metrics]


def test_later_steps_of_a_round_see_the_round_start_policy():
    trainer = make_trainer(make_config(train={"learning_rate": 1e-2}))
    metrics = trainer.train_epochs([make_batch(seed=s) for s in range(4)], round_index=0)
    ratios = _ratio_and_clip(metrics)
    assert ratios[0] == (1.0, 0.0)  # pi_old is this step's own forward: exactly 1
    for ratio, clip_fraction in ratios[1:]:
        assert ratio != pytest.approx(1.0, abs=1e-3)
        assert clip_fraction > 0
    assert metrics[3][0]["train/ppo_kl"] != 0.0


def test_behaviour_old_logprobs_move_the_first_ratio():
    algorithm = replace(AlgorithmConfig(), old_logprobs="behaviour")
    trainer = make_trainer(make_config(algorithm=algorithm, train={"learning_rate": 1e-2}))
    (first, _), *_ = trainer.train_epochs([make_batch(seed=0)], round_index=0)
    # make_batch's behaviour log-probs are -(2..3): not the policy's, so the first ratio is already off 1.
    assert first["train/ratio_mean"] != pytest.approx(1.0, abs=1e-2)


def test_ppo_epochs_pass_twice_with_the_round_start_as_pi_old():
    trainer = make_trainer(make_config(train={"learning_rate": 1e-2, "ppo_epochs": 2}))
    steps = [make_batch(seed=s) for s in range(2)]
    metrics = trainer.train_epochs(steps, round_index=3)
    assert [m["train/epoch"] for m, _ in metrics] == [0.0, 0.0, 1.0, 1.0]
    assert metrics[0][0]["train/ratio_mean"] == 1.0
    for m, _ in metrics[1:]:
        assert m["train/ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    second_pass = sorted(tuple(b.prompt_ids[::4, -1].tolist()) for _, b in metrics[2:])
    first_pass = sorted(tuple(b.prompt_ids[::4, -1].tolist()) for _, b in metrics[:2])
    assert sorted(sum(second_pass, ())) == sorted(sum(first_pass, ()))  # the same groups, re-dealt


def _sample_key(behaviour_logprobs_row: torch.Tensor) -> tuple[float, ...]:
    """make_batch's behaviour log-probs are random floats: they name a sample in any step it is re-dealt to."""
    return tuple(behaviour_logprobs_row.tolist())


def test_every_ppo_epoch_uses_the_round_start_policy_as_pi_old():
    """Not only ratio != 1: pi_old of every sample, in every step of every pass, equals the log-probs of the
    policy the round started from, as the objective receives them (recomputing pi_old at the current weights
    for a later pass also gives ratios != 1)."""
    trainer = make_trainer(make_config(train={"learning_rate": 1e-2, "ppo_epochs": 2}))
    steps = [make_batch(seed=s) for s in range(2)]
    trainer.model.train()  # as train_epochs takes pi_old
    round_start = {}
    for batch in steps:
        logprobs = trainer.logprobs_no_grad(trainer.model, batch)
        for row in range(batch.num_samples):
            round_start[_sample_key(batch.behaviour_logprobs[row])] = (logprobs[row], batch.response_mask[row].bool())
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    objective = trainer.objective

    def recording(**inputs):
        seen.append((inputs["behaviour_logprobs"].detach().cpu(), inputs["old_logprobs"].detach().cpu()))
        return objective.loss(**inputs)

    trainer.objective = dataclasses.replace(objective, loss=recording)
    metrics = trainer.train_epochs(steps, round_index=3)

    assert [m["train/epoch"] for m, _ in metrics] == [0.0, 0.0, 1.0, 1.0]
    checked = {}
    for behaviour, old in seen:
        for row in range(behaviour.shape[0]):
            key = _sample_key(behaviour[row])
            start, mask = round_start[key]
            torch.testing.assert_close(old[row][mask], start[mask])
            checked[key] = checked.get(key, 0) + 1
    assert sorted(checked.values()) == [2] * len(round_start), "every sample trained once per pass"
    after = trainer.logprobs_no_grad(trainer.model, steps[1])
    start = torch.stack([round_start[_sample_key(row)][0] for row in steps[1].behaviour_logprobs])
    mask = steps[1].response_mask.bool()
    assert (after - start)[mask].abs().max() > 1e-3, "the round moved the policy: a later pi_old would differ"


def test_epoch_permutation_depends_only_on_seed_round_and_epoch():
    assert epoch_permutation(8, seed=1, round_index=2, epoch=0) == list(range(8))
    first = epoch_permutation(8, seed=1, round_index=2, epoch=1)
    assert first == epoch_permutation(8, seed=1, round_index=2, epoch=1)
    assert sorted(first) == list(range(8)) and first != list(range(8))
    assert first != epoch_permutation(8, seed=2, round_index=2, epoch=1)
    assert first != epoch_permutation(8, seed=1, round_index=3, epoch=1)


def test_epoch_steps_keep_old_logprobs_with_their_samples():
    steps = [make_batch(seed=s, num_groups=2) for s in range(2)]
    steps = [b.with_old_logprobs(b.behaviour_logprobs * 0 + i) for i, b in enumerate(steps)]
    shuffled = epoch_steps(steps, epoch=1, seed=0, round_index=0, pad_token_id=0)
    assert [b.num_groups for b in shuffled] == [2, 2]
    for batch in shuffled:
        for row in range(batch.num_samples):  # a sample's old log-probs identify the step it came from
            source = int(batch.old_logprobs[row, 0])
            match = (steps[source].prompt_ids == batch.prompt_ids[row]).all(-1)
            assert match.any()
