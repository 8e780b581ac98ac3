"""Score mappings whose range does not start at 0: a judge's ``number:LO,HI`` rule with LO != 0 (a 1-10 scale, a
scale around 0), and the reward model's ``tanh`` and ``clip`` normalisations, whose rewards go below 0. Each maps
the range's ends onto the rewards it documents, and ``answer_ok`` is decided at the documented point of the range
(the judge: a score >= 0.5 of [0, 1]; the reward model: the image of raw logit 0), not at a point of [0, 1].

No model, no server: the judge's backend is a fake that answers the given verdicts (the scorer is real); the reward
model's ``record`` runs on a scorer without a loaded model (it reads only the normalisation).
"""

from __future__ import annotations

import math

import pytest

from colossal_rl.reward.judge import JudgeScorer, JudgeTemplate, VerdictError, parse_verdict_rule
from colossal_rl.reward.records import OK
from colossal_rl.reward.reward_model import NORMALISATIONS, RewardModelConfig, RewardModelScorer

TEMPLATE = JudgeTemplate("Answer: {response}\nScore it.")


class ScriptedJudge:
    """A judge backend answering each prompt with the next scripted verdict."""

    def __init__(self, verdicts: list[str]):
        self.verdicts = list(verdicts)

    def complete(self, prompts: list[str]) -> list[str]:
        answered, self.verdicts = self.verdicts[: len(prompts)], self.verdicts[len(prompts) :]
        return answered

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("rule", "verdict", "score"),
    [
        ("number:1,10", "Score: 1", 0.0),  # the bottom of the scale is reward 0, not 0.1
        ("number:1,10", "Score: 10", 1.0),
        ("number:1,10", "Score: 5.5", 0.5),
        ("number:1,10", "Score: 4", 1 / 3),
        ("number:-5,5", "\\boxed{-5}", 0.0),
        ("number:-5,5", "\\boxed{0}", 0.5),
        ("number:-5,5", "\\boxed{2.5}", 0.75),
        ("number:2,4", "of 4, 2.5", 0.25),  # the last number
    ],
)
def test_a_number_scale_not_starting_at_0_maps_its_ends_onto_0_and_1(rule, verdict, score):
    assert parse_verdict_rule(rule).score(verdict) == pytest.approx(score)


@pytest.mark.parametrize(("rule", "verdict"), [("number:1,10", "Score: 0"), ("number:-5,5", "Score: -6")])
def test_a_number_below_a_scale_not_starting_at_0_is_refused(rule, verdict):
    with pytest.raises(VerdictError, match="outside"):
        parse_verdict_rule(rule).score(verdict)


def test_the_judges_rewards_and_answer_ok_on_a_1_to_10_scale():
    """Through ``JudgeScorer``: a 1-10 verdict becomes (v - 1) / 9, and ``answer_ok`` is its half-way point 5.5."""
    verdicts = ["Score: 1", "Score: 5", "Score: 5.5", "Score: 10"]
    scorer = JudgeScorer(TEMPLATE, parse_verdict_rule("number:1,10"), ScriptedJudge(verdicts))
    records = scorer.score_batch(["a"] * 4, [{"messages": {"role": "user", "content": "q"}}] * 4)
    assert [record.status for record in records] == [OK] * 4
    assert [record.reward for record in records] == pytest.approx([0.0, 4 / 9, 0.5, 1.0])
    assert [record.answer_ok for record in records] == [False, False, True, True]
    assert [record.details["judge_score"] for record in records] == pytest.approx([0.0, 4 / 9, 0.5, 1.0])


def scorer_with(normalisation: str) -> RewardModelScorer:
    """A reward-model scorer whose ``record`` maps raw scores with ``normalisation`` (no model loaded)."""
    scorer = RewardModelScorer.__new__(RewardModelScorer)
    scorer.config = RewardModelConfig(normalisation=normalisation)
    scorer.normalisation = NORMALISATIONS[normalisation]
    return scorer


@pytest.mark.parametrize(
    ("normalisation", "raw", "reward", "answer_ok"),
    [
        ("tanh", -2.0, math.tanh(-2.0), False),
        ("tanh", -0.1, math.tanh(-0.1), False),  # below raw 0: not ok, though in (-1, 0) and not 0
        ("tanh", 0.1, math.tanh(0.1), True),  # above raw 0: ok, though below 0.5
        ("tanh", 30.0, 1.0, True),
        ("clip", -7.0, -5.0, False),  # clipped to the range's bottom, -5, not 0
        ("clip", -3.0, -3.0, False),  # inside the range: kept, negative
        ("clip", 0.25, 0.25, True),
        ("clip", 9.0, 5.0, True),
        ("raw", -3.5, -3.5, False),
        ("sigmoid", -0.1, 1 / (1 + math.exp(0.1)), False),
        ("sigmoid", 0.1, 1 / (1 + math.exp(-0.1)), True),
    ],
)
def test_reward_model_normalisations_keep_negative_rewards_and_judge_ok_at_raw_0(normalisation, raw, reward, answer_ok):
    record = scorer_with(normalisation).record(raw)
    assert record.status == OK and record.details["raw_score"] == raw
    assert record.reward == pytest.approx(reward)
    assert record.answer_ok is answer_ok


@pytest.mark.parametrize("normalisation", sorted(NORMALISATIONS))
def test_each_normalisations_threshold_is_the_image_of_raw_0(normalisation):
    mapping = NORMALISATIONS[normalisation]
    assert mapping.apply(0.0) == pytest.approx(mapping.answer_threshold)
