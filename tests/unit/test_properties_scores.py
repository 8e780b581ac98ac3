"""Property-based tests of the score mappings of the model rewards: a judge's verdict rule (``reward/judge.py``:
``number:LO,HI`` maps LO..HI linearly onto 0..1, ``choice`` maps tokens to their scores) and a reward model's
normalisations of its raw logit (``reward/reward_model.py``), including where a sample counts as answered right.

Ranges are drawn anywhere on the line, not only from 0: a mapping that forgets to subtract the range's start, or
scales by the wrong end, fails at the range's ends.
"""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from colossal_rl.reward.judge import (
    ChoiceRule,
    JudgeScorer,
    JudgeTemplate,
    NumberRule,
    VerdictError,
    parse_verdict_rule,
)
from colossal_rl.reward.reward_model import NORMALISATIONS, RewardModelScorer

PROPERTY = settings(max_examples=100, deadline=None, derandomize=True, database=None)
ENDS = st.integers(-50, 50).map(float) | st.sampled_from([-2.5, 0.5, 7.25])


class ScriptedJudge:
    """A judge backend answering each prompt with the next scripted verdict."""

    def __init__(self, verdicts: list[str]):
        self.verdicts = list(verdicts)

    def complete(self, prompts: list[str]) -> list[str]:
        answers, self.verdicts = self.verdicts[: len(prompts)], self.verdicts[len(prompts) :]
        return answers

    def close(self) -> None:
        pass


def number(value: float) -> str:
    return repr(float(value))


@PROPERTY
@given(low=ENDS, width=st.integers(1, 40), fraction=st.fractions(0, 1, max_denominator=8))
def test_a_number_rule_maps_its_range_ends_to_0_and_1_and_linearly_between(low, width, fraction):
    """``number:LO,HI``: LO scores 0, HI scores 1, LO + f (HI - LO) scores f, whatever LO's sign; a number just
    outside the range does not parse."""
    high = low + width
    rule = parse_verdict_rule(f"number:{number(low)},{number(high)}")
    assert rule.score(f"Score: {number(low)}") == 0.0
    assert rule.score(f"Score: {number(high)}") == 1.0
    assert math.isclose(
        rule.score(f"\\boxed{{{number(low + float(fraction) * width)}}}"), float(fraction), abs_tol=1e-9
    )
    for outside in (low - 1, high + 1):
        try:
            rule.score(f"Score: {number(outside)}")
        except VerdictError:
            continue
        raise AssertionError(f"{outside} outside [{low}, {high}] parsed")


@PROPERTY
@given(
    low=ENDS, width=st.integers(1, 40), values=st.lists(st.fractions(0, 1, max_denominator=8), min_size=2, max_size=6)
)
def test_a_number_rule_is_monotone_and_stays_in_0_1(low, width, values):
    """Higher verdicts score higher, and every score is in [0, 1]."""
    rule = NumberRule(low, low + width)
    numbers = sorted(low + float(value) * width for value in values)
    scores = [rule.score(f"Score: {number(value)}") for value in numbers]
    assert scores == sorted(scores) and all(0.0 <= score <= 1.0 for score in scores)


@PROPERTY
@given(
    low=ENDS,
    width=st.integers(1, 40),
    fractions=st.lists(st.fractions(0, 1, max_denominator=8), min_size=1, max_size=5),
)
def test_a_judge_reward_is_the_mapped_score_and_answer_ok_from_the_ranges_midpoint(low, width, fractions):
    """Through ``JudgeScorer``: each sample's reward is its verdict mapped onto [0, 1] (LO -> 0, HI -> 1), and
    ``answer_ok`` holds exactly from the range's midpoint up."""
    high = low + width
    verdicts = [f"The answer is fine. Score: {number(low + float(f) * width)}" for f in fractions]
    scorer = JudgeScorer(JudgeTemplate("{prompt} {response}"), NumberRule(low, high), ScriptedJudge(verdicts))
    rows = [{"messages": {"role": "user", "content": "q"}}] * len(fractions)
    records = scorer.score_batch(["r"] * len(fractions), rows)
    for record, fraction in zip(records, fractions, strict=True):
        assert math.isclose(record.reward, float(fraction), abs_tol=1e-9)
        assert record.answer_ok == (fraction >= 0.5)


@PROPERTY
@given(
    scores=st.dictionaries(
        st.sampled_from(["yes", "no", "A", "B", "maybe"]), st.fractions(0, 1, max_denominator=4), min_size=1, max_size=5
    ),  # fmt: skip
    picks=st.lists(st.integers(0, 4), min_size=1, max_size=4),
)
def test_a_choice_rule_gives_the_last_choice_named_its_own_score(scores, picks):
    """``choice:T=S,...``: a verdict naming several choices scores the last one named, in any case."""
    rule = ChoiceRule(tuple((token, float(value)) for token, value in scores.items()))
    tokens = list(scores)
    named = [tokens[pick % len(tokens)] for pick in picks]
    verdict = "I considered " + ", then ".join(token.upper() if i % 2 else token for i, token in enumerate(named))
    assert rule.score(verdict) == float(scores[named[-1]])


@PROPERTY
@given(name=st.sampled_from(sorted(NORMALISATIONS)), raws=st.lists(st.floats(-60, 60), min_size=2, max_size=6))
def test_a_reward_model_normalisation_is_monotone_bounded_and_answers_right_above_raw_zero(name, raws):
    """Each normalisation is non-decreasing, within its range (sigmoid (0, 1)-ish [0, 1], tanh [-1, 1], clip
    [-5, 5]); its ``answer_threshold`` is the image of raw 0, so a record is ``answer_ok`` exactly for raw > 0."""
    normalisation = NORMALISATIONS[name]
    assert normalisation.apply(0.0) == normalisation.answer_threshold
    rewards = [normalisation.apply(raw) for raw in sorted(raws)]
    assert rewards == sorted(rewards)
    bounds = {"sigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0), "clip": (-5.0, 5.0), "raw": (-math.inf, math.inf)}[name]
    assert all(bounds[0] <= reward <= bounds[1] for reward in rewards)
    scorer = RewardModelScorer.__new__(RewardModelScorer)  # record() needs only the normalisation, not a model
    scorer.normalisation = normalisation
    for raw in raws:
        assume(name != "sigmoid" or abs(raw) > 1e-7)  # sigmoid(tiny) rounds to 0.5 in float64
        record = scorer.record(raw)
        assert record.answer_ok == (raw > 0), f"{name}({raw}) = {record.reward}"
        assert record.reward == normalisation.apply(raw)
