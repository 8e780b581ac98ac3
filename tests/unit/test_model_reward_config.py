"""Model-scored rewards in the config and the factory (``-rt model``, ``-rt judge``, ``model``/``judge`` in
``--reward-mix``): what each needs, what is refused in one line naming the flag, which reward the reward actors
serve and how many there are, and that a producer's scorer is the client to those actors (or, for a judge behind
``--judge-url``, the endpoint judge itself)."""

from __future__ import annotations

import pytest

from colossal_rl.command_line import UsageError, config_from_args, parse_args
from colossal_rl.prompts import system_prompt_for
from colossal_rl.reward import JudgeSettings, RewardConfigError, RewardRecord, build_reward_scorer
from colossal_rl.reward.combined import CombinedScorer
from colossal_rl.reward.judge import JudgeScorer


def config_of(*argv: str):
    return config_from_args(parse_args(list(argv)))


JUDGE = ("-rt", "judge", "--judge-template", "judge.txt", "--judge-model", "judge-llm")


@pytest.mark.parametrize(
    "argv, message",
    [
        (("-rt", "model"), "--reward-model: -rt model .* needs --reward-model"),
        (("--reward-model", "rm"), "--reward-model: applies to -rt model"),
        (("-rt", "judge", "--judge-model", "m"), "--judge-template: -rt judge needs --judge-template"),
        (("-rt", "judge", "--judge-template", "t.txt"), "--judge-model: -rt judge needs --judge-model"),
        (("--judge-url", "http://127.0.0.1:1/v1"), "--judge-url: applies to -rt judge"),
        (
            (
                "--reward-mix",
                "boxed=0,model=1,judge=1",
                "--reward-model",
                "rm",
                "--judge-template",
                "t",
                "--judge-model",
                "m",
            ),
            "--judge-url: the reward actors serve one model",
        ),  # fmt: skip
        (("-rt", "model", "--reward-model", "rm", "--reward-actors", "0"), "--reward-actors: must be >= 1"),
    ],
)
def test_what_a_model_reward_needs_is_refused_in_one_line_naming_the_flag(argv, message):
    with pytest.raises(UsageError, match=message):
        config_of(*argv)


@pytest.mark.parametrize(
    "argv, served, actors",
    [
        (("-rt", "model", "--reward-model", "rm", "--reward-actors", "2"), "model", 2),
        (("--reward-mix", "boxed=0,model=1", "--reward-model", "rm"), "model", 1),
        (JUDGE, "judge", 1),
        ((*JUDGE, "--judge-url", "http://127.0.0.1:1/v1"), None, 0),
        (
            (
                "--reward-mix",
                "boxed=1,model=1,judge=1",
                "--reward-model",
                "rm",
                "--judge-template",
                "t",
                "--judge-model",
                "m",
                "--judge-url",
                "http://127.0.0.1:1/v1",
            ),
            "model",
            1,
        ),  # fmt: skip
        ((), None, 0),
    ],
)
def test_which_reward_the_reward_actors_serve_and_how_many_there_are(argv, served, actors):
    reward = config_of(*argv).reward
    assert (reward.served, reward.num_reward_actors) == (served, actors)


def test_a_verifiable_reward_listed_first_keeps_its_system_prompt_while_the_model_trains():
    config = config_of("--reward-mix", "boxed=0,model=1", "--reward-model", "rm")
    assert config.reward.reward_type == "boxed" and "boxed" in system_prompt_for("boxed", None)
    assert system_prompt_for(config_of("-rt", "model", "--reward-model", "rm").reward.reward_type, None) == (
        "You are a helpful assistant."
    )


class Served:
    """Stands in for the client to the reward actors (``comm/remote_reward.py``): a fixed score per response."""

    def __init__(self):
        self.calls, self.closed = 0, False

    def score_batch(self, responses, rows):
        self.calls += 1
        return [RewardRecord(0.25, True, False, "ok", {}) for _ in responses]

    def close(self):
        self.closed = True


def test_a_served_reward_type_is_scored_by_the_client_to_the_reward_actors():
    served = Served()
    assert build_reward_scorer("model", served=served) is served
    with pytest.raises(RewardConfigError, match="scored on the run's reward actors"):
        build_reward_scorer("model")
    local_judge = JudgeSettings(template="t.txt", model="judge-llm")
    assert build_reward_scorer("judge", served=served, judge=local_judge) is served


def test_a_judge_behind_an_endpoint_is_asked_by_the_producer_itself(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Rate {response} for {prompt} from 0 to 1. Score:")
    judge = JudgeSettings(template=str(template), url="http://127.0.0.1:9/v1", model="judge-llm")
    scorer = build_reward_scorer("judge", judge=judge, reward_timeout_s=1.0, reward_batch_budget_s=2.0)
    try:
        assert isinstance(scorer, JudgeScorer)
    finally:
        scorer.close()


def test_a_mix_weighs_the_served_models_score_with_a_verifier_whose_correctness_counts():
    served = Served()
    scorer = build_reward_scorer(reward_mix=(("boxed", 0.0), ("model", 2.0)), served=served)
    assert isinstance(scorer, CombinedScorer)
    try:
        right, wrong = scorer.score_batch(["\\boxed{4}", "\\boxed{5}"], [{"gt_answer": "4"}, {"gt_answer": "4"}])
    finally:
        scorer.close()
    assert (right.reward, wrong.reward) == (0.5, 0.5)  # 0 x boxed + 2 x the model's 0.25
    assert (right.answer_ok, wrong.answer_ok) == (True, False)  # boxed, listed first, decides correctness
    assert served.calls == 1


# --- the precision a reward actor's model loads in (issue 61, item 6) ----------------------------------------------
@pytest.mark.parametrize(
    "device, dtype", [("cuda", "bfloat16"), ("cuda:1", "bfloat16"), ("cpu", "float32"), ("meta", "float32")]
)
def test_served_models_score_in_bf16_on_gpus_as_the_trainers_do_and_fp32_elsewhere(device, dtype):
    from colossal_rl.reward.model_rewards import scoring_dtype

    assert scoring_dtype(device) == dtype


@pytest.mark.parametrize("device, dtype", [("cuda", "bfloat16"), ("cpu", "float32")])
def test_a_served_scorer_built_for_a_device_loads_its_model_in_that_devices_dtype(monkeypatch, device, dtype):
    """The reward actor builds its scorer for ``cuda`` when Ray gave it a GPU: the reward model's config and the
    local judge's load both carry bfloat16 there (a 14B judge in float32 would take 56 GB before its KV cache). The
    model classes are replaced by recorders: nothing is loaded, no GPU is needed."""
    from colossal_rl.reward import build_served_scorer, judge_local, reward_model

    built = {}
    monkeypatch.setattr(reward_model, "RewardModelScorer", lambda path, config: built.setdefault("model", config))
    monkeypatch.setattr(judge_local, "LocalModelJudge", lambda path, **kwargs: built.setdefault("judge", kwargs))
    monkeypatch.setattr("colossal_rl.reward.judge.JudgeTemplate.from_file", lambda path: "template")
    build_served_scorer("model", reward_model="rm", device=device)
    build_served_scorer("judge", judge=JudgeSettings(template="judge.txt", model="judge-llm"), device=device)
    assert (built["model"].device, built["model"].dtype) == (device, dtype)
    assert (built["judge"]["device"], built["judge"]["dtype"]) == (device, dtype)
