"""Every --algo preset trains on the embedded model through the real producer, round schedule and trainer, and trains
as itself — in this process, one preset after another (no actors to start per preset).

The pieces are the ones a run holds: ``Producer`` (transformers backend, the preset's scoring and post-processing),
``RoundScheduler`` (the driver's round schedule; DAPO's short rounds carried over) and ``Trainer`` (world size 1 over
gloo), with ``n_behind`` 1: rounds 0 and 1 are generated with version 0, round ``r`` is trained, its weights go to
the producer as version ``r + 1``, then round ``r + 2`` is generated. What Ray adds (the actors, the object store,
the weight-sync group) is the same for every preset and runs end to end in the other modules here.

Each run has two optimizer steps per round (8 prompts sampled, 4 per step), so the second step of every round trains
with pi_old = the round's starting policy and a ratio != 1: that is where the presets' losses differ (at ratio 1
GRPO's and GSPO's losses and gradients coincide). Checked: every preset trains at least the steps it asks for — DAPO
included, whose dynamic sampling may leave a round short of a step, so its run continues round by round up to
``MAX_ROUNDS`` — with finite losses, and no two presets train bit-identically.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import GenerationConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.presets import PRESETS, algorithm_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # trainer_harness: the in-process trainer

pytestmark = [pytest.mark.slow]

ROUNDS = 2
STEPS_PER_ROUND = 2
REQUESTED_STEPS = ROUNDS * STEPS_PER_ROUND
MAX_ROUNDS = 4
"""Rounds a preset may take to reach ``REQUESTED_STEPS`` (DAPO drops groups whose samples all agree)."""
COMPARED = ("train/loss", "train/grad_norm", "train/entropy", "train/reward")


def preset_config(name: str, save_dir: str) -> RLConfig:
    config = RLConfig(
        generation=GenerationConfig(num_generations=4, microbatch_size=8, max_new_tokens=16),
        algorithm=algorithm_preset(name, kl_coeff=0.01, max_new_tokens=16, n_behind=1),
        train=TrainConfig(batch_size=4, minibatch_size=4, microbatch_size=16),
        schedule=ScheduleConfig(num_producers=1, inference_batch_size=8, n_behind=1),
        run=RunConfig(project=name, save_dir=save_dir, eval_interval=0, timeout_s=120),
    ).validate()
    assert config.optimizer_steps_per_round == STEPS_PER_ROUND
    return config


def train_preset(config: RLConfig, scorer) -> list[dict]:
    """Rounds until ``REQUESTED_STEPS`` optimizer steps are trained (at most ``MAX_ROUNDS``); each step's metrics.
    ``scorer``: the math reward scorer, shared (its worker process starts once, not once per preset).

    The round schedule's decisions are the run's own (``RoundScheduler`` with the driver's settings); they are
    carried out here one after another, as ``driver/schedule_loop.py`` does on the actors: the due sync, the
    admitted chunks, then the round's steps."""
    import dataclasses

    from trainer_harness import make_trainer

    from colossal_rl.batch import concat_batches
    from colossal_rl.driver.schedules import round_settings
    from colossal_rl.rollout.producer import Producer
    from colossal_rl.schedule.prompts import episode_rows
    from colossal_rl.schedule.rounds import RoundScheduler

    config = resolve(config)  # as run_training gives it
    producer = Producer(0, config, scorer)
    trainer = make_trainer(config)
    trainer.set_total_steps(REQUESTED_STEPS)  # the LR schedule's end, as the driver sets it for ROUNDS rounds
    settings = dataclasses.replace(round_settings(config, MAX_ROUNDS), max_steps=REQUESTED_STEPS)
    scheduler = RoundScheduler(settings, episode_rows(len(producer.train_data), config.data.seed))
    batches = {}  # chunk id -> its kept groups' batch

    def step_batch(groups) -> RolloutBatch:
        """A step's groups cut out of their chunks' batches, by row, and joined in order."""
        parts = []
        for group in groups:
            batch = batches[group.chunk_id]
            parts.append(batch.select_groups([batch.data_indices.index(group.row)]))
        return concat_batches(parts, trainer.pad_token_id)

    records: list[dict] = []
    for _ in range(4 * MAX_ROUNDS):  # every pass makes progress: a sync, chunks or a round's steps
        if scheduler.finished:
            break
        version = scheduler.sync_due()
        if version is not None:
            producer.load_weights(version, trainer.stage_state_dict())
            scheduler.sync_ordered(version)
        for chunk_order in scheduler.admit():
            assert chunk_order.policy_version == producer.policy_version  # round r generated with max(0, r - 1)
            chunk = producer.produce_chunk(
                chunk_order.chunk_id, list(chunk_order.rows), seed_index=chunk_order.sampling_seed_index
            )
            batches[chunk_order.chunk_id] = chunk.batch
            scheduler.chunk_done(chunk_order.chunk_id, list(chunk.groups))
        order = scheduler.next_step()
        if order is None:
            continue
        trainer.policy_version = order.trainer_version
        steps = [step_batch(groups) for groups in order.step_groups()]
        for metrics, batch in trainer.train_epochs(steps, order.trainer_version):
            records.append(metrics | {"train/reward": float(batch.rewards.mean())})
        scheduler.step_done()
    assert scheduler.finished, "the round schedule did not end"
    return records


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict]]:
    from colossal_rl.reward import build_reward_scorer

    names = sorted(PRESETS.names())
    assert set(names) == {"GRPO", "DAPO", "RLOO", "REINFORCE_PPB", "DR_GRPO", "GSPO", "ONLINE_DPO"}
    scorer = build_reward_scorer(reward_type="boxed")
    try:
        return {name: train_preset(preset_config(name, "unused"), scorer) for name in names}
    finally:
        scorer.close()


def test_every_preset_trains_its_requested_steps(trained):
    for name, train in trained.items():
        assert len(train) >= REQUESTED_STEPS, f"{name} trained {len(train)} of {REQUESTED_STEPS} steps"
        assert all(math.isfinite(r["train/loss"]) for r in train), name
        if preset_config(name, "unused").algorithm.kl_coeff > 0:  # DAPO drops the KL term
            assert all(math.isfinite(r["train/kl"]) for r in train), name


def test_no_two_presets_train_identically(trained):
    curves = {name: [tuple(r[key] for key in COMPARED) for r in train] for name, train in trained.items()}
    for (name, curve), (other, other_curve) in itertools.combinations(curves.items(), 2):
        assert curve != other_curve, f"{name} and {other} trained bit-identically"
    # GRPO and GSPO share advantages and aggregation: only the ratio != 1 steps (pi_old recomputed) tell them apart.
    later_steps = slice(1, REQUESTED_STEPS, STEPS_PER_ROUND)
    assert curves["GRPO"][later_steps] != curves["GSPO"][later_steps]


def test_gspo_sequence_clip_acts(trained):
    """GSPO clips whole sequences at 1 -3e-4/+4e-4: the second step of a round (pi_old = the round's start)
    must show clipping (measured: clip fractions 0.94 and 0.44; first steps 0, ratio exactly 1)."""
    assert any(r["train/clip_fraction"] > 0 for r in trained["GSPO"])


def test_online_dpo_starts_at_the_reference_and_moves_away(trained):
    """The first step's policy is the reference model: every pair's DPO loss is log 2 exactly; after an update the
    policy's log-ratios to the reference are no longer zero."""
    train = trained["ONLINE_DPO"]
    assert train[0]["train/loss"] == pytest.approx(math.log(2), rel=1e-4)
    assert train[0]["train/dpo_margin"] == pytest.approx(0.0, abs=1e-4)
    assert any(abs(r["train/dpo_chosen_log_ratio"]) > 1e-3 for r in train[1:])
    assert "train/clip_fraction" not in train[0]  # no ratio to pi_old in DPO
