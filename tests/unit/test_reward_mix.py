"""``--reward-mix``: a weighted sum of named rewards (``reward/combined.py``), from the flag or a ``--config`` file,
scored by real built-in scorers and a real plug-in, each component logged as ``rollout/reward_<name>_mean`` by a
real producer on the embedded model."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from colossal_rl.command_line import config_from_args, parse_args
from colossal_rl.config import (
    ConfigError,
    EnvironmentConfig,
    GenerationConfig,
    RewardConfig,
    RLConfig,
    mix_component_name,
)
from colossal_rl.config_files import ConfigFileError, config_to_yaml, load_config_file
from colossal_rl.config_resolve import resolve
from colossal_rl.flags import parse_reward_mix
from colossal_rl.reward import INFRA_ERROR, CombinedScorer, RewardConfigError, build_reward_scorer
from colossal_rl.reward.combined import COMPONENTS, component_name
from colossal_rl.rollout.producer import Producer

PLUGINS = """
def length_bonus(response, row):
    return len(response) / 100

def judge_down(response, row):
    raise RuntimeError("judge unreachable")
"""


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "my_rewards.py"
    path.write_text(PLUGINS)
    return path


# ------------------------------------------------------------------ the flag and the config file


def test_the_flag_parses_spec_weight_pairs_in_order():
    assert parse_reward_mix("boxed=1, my_rewards.py:brevity=0.2") == (("boxed", 1.0), ("my_rewards.py:brevity", 0.2))
    assert parse_reward_mix("") == ()
    config = config_from_args(parse_args(["--reward-mix", "boxed=1,pkg.module:style=-0.5"]))
    assert config.reward.mix == (("boxed", 1.0), ("pkg.module:style", -0.5))
    assert config.reward.mix_names == ("boxed", "style")
    assert config.reward.label == "--reward-mix boxed=1,pkg.module:style=-0.5"


@pytest.mark.parametrize("item", ["boxed", "boxed=heavy", "=1"])
def test_a_malformed_flag_item_is_named_with_the_flag(item, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=f"bad item {item!r}"):
        parse_reward_mix(f"think_answer_tags=1,{item}")
    with pytest.raises(SystemExit):
        parse_args(["--reward-mix", item])
    assert f"argument --reward-mix: bad item {item!r}" in capsys.readouterr().err


def test_the_config_file_takes_a_list_of_pairs_and_round_trips(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text('reward:\n  mix: [[boxed, 1], ["my_rewards.py:brevity", 0.2]]\n')
    expected = (("boxed", 1.0), ("my_rewards.py:brevity", 0.2))
    assert load_config_file(path).reward.mix == expected
    assert config_from_args(parse_args(["--config", str(path)])).reward.mix == expected
    flag_wins = config_from_args(parse_args(["--config", str(path), "--reward-mix", "boxed=2"]))
    assert flag_wins.reward.mix == (("boxed", 2.0),)
    written = tmp_path / "written.yaml"
    written.write_text(config_to_yaml(load_config_file(path)))
    assert load_config_file(written).reward.mix == expected


@pytest.mark.parametrize(
    ("mix", "message"),
    [("[[boxed]]", "reward.mix: expected a list of 2 items"), ('[[boxed, "heavy"]]', "reward.mix: expected float")],
)
def test_a_malformed_config_file_mix_names_the_file_and_field(tmp_path, mix, message):
    path = tmp_path / "run.yaml"
    path.write_text(f"reward:\n  mix: {mix}\n")
    with pytest.raises(ConfigFileError, match=message):
        load_config_file(path)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (RewardConfig(mix=(("boxed", math.nan),)), "weight must be a finite number"),
        (RewardConfig(mix=(("boxed", 0.0), ("a.py:f", 0.0))), "at least one non-zero weight"),
        (RewardConfig(mix=(("boxed", 1.0), ("a.py:score", 1.0), ("b.py:score", 1.0))), "score repeat"),
        (RewardConfig(mix=(("boxed", 1.0),), reward_fn="a.py:f"), "replaces --reward-fn"),
        (RewardConfig(mix=(("regex", 1.0),)), "'regex' is neither a reward type"),
        (RewardConfig(mix=(("a.py:f", 1.0), ("code", 1.0))), "add -rt code"),
    ],
)
def test_an_invalid_mix_is_refused_naming_the_field(reward, message):
    with pytest.raises(ConfigError, match=message) as raised:
        reward.validate()
    assert raised.value.field_path == "reward.mix"


def test_the_config_and_the_scorer_name_components_alike():
    for spec in ("boxed", "code", "my_rewards.py:brevity", "dir/x.py:style", "pkg.module:judge"):
        assert mix_component_name(spec) == component_name(spec)


# ------------------------------------------------------------------ scoring


def test_the_reward_is_the_weighted_sum_and_the_first_component_decides_status(plugin_file):
    mix = (("boxed", 1.0), ("think_answer_tags", 0.5), (f"{plugin_file}:length_bonus", 2.0))
    scorer = build_reward_scorer(reward_mix=mix, reward_timeout_s=30.0)
    assert isinstance(scorer, CombinedScorer)
    responses = ["The answer is \\boxed{4}.", "<think>2+2</think><answer>4</answer>"]
    try:
        boxed, tagged = scorer.score_batch(responses, [{"gt_answer": "4"}] * 2)
    finally:
        scorer.close()
    assert boxed.details[COMPONENTS] == {"boxed": 1.0, "think_answer_tags": 0.0, "length_bonus": 0.24}
    assert tagged.details[COMPONENTS] == {"boxed": 0.0, "think_answer_tags": 1.0, "length_bonus": 0.36}
    assert boxed.reward == pytest.approx(1.0 + 0.5 * 0.0 + 2.0 * 0.24)
    assert tagged.reward == pytest.approx(0.0 + 0.5 * 1.0 + 2.0 * 0.36)
    assert (boxed.status, boxed.answer_ok, boxed.format_ok) == ("ok", True, True)
    # think_answer_tags found the answer, but boxed (first) did not: the sample is boxed's verdict
    assert (tagged.status, tagged.answer_ok, tagged.format_ok) == ("format_error", False, False)
    assert set(tagged.details["component_details"]) == {"boxed", "think_answer_tags", "length_bonus"}


def test_a_component_that_cannot_score_makes_the_sample_an_infra_error(plugin_file):
    mix = (("boxed", 1.0), (f"{plugin_file}:judge_down", 0.3))
    scorer = build_reward_scorer(reward_mix=mix, reward_timeout_s=30.0)
    try:
        (record,) = scorer.score_batch(["\\boxed{4}"], [{"gt_answer": "4"}])
    finally:
        scorer.close()
    assert record.status == INFRA_ERROR and record.reward == 0.0 and not record.answer_ok
    assert record.details["component"] == "judge_down"
    assert "'judge_down'" in record.details["error"] and "judge unreachable" in record.details["error"]
    assert record.details[COMPONENTS]["boxed"] == 1.0  # what the others gave, for the logs


def test_the_factory_refuses_what_a_mix_cannot_use(tmp_path, plugin_file):
    other = tmp_path / "other.py"
    other.write_text("def length_bonus(response, row):\n    return 0.0\n")
    with pytest.raises(RewardConfigError, match=r"\['length_bonus'\] repeat"):
        build_reward_scorer(reward_mix=((f"{plugin_file}:length_bonus", 1), (f"{other}:length_bonus", 1)))
    with pytest.raises(RewardConfigError, match="do not apply with reward_mix"):
        build_reward_scorer(reward_fn=f"{plugin_file}:length_bonus", reward_mix=(("boxed", 1),))
    with pytest.raises(RewardConfigError, match="'regex': neither a reward type"):
        build_reward_scorer(reward_mix=(("boxed", 1), ("regex", 1)))


def test_an_empty_mix_is_the_single_reward_unchanged():
    assert RLConfig().reward.mix == () and RLConfig().reward.label == "-rt boxed"
    responses, rows = ["\\boxed{4}", "\\boxed{5}", "no answer"], [{"gt_answer": "4"}] * 3
    plain, empty_mix = build_reward_scorer("boxed"), build_reward_scorer("boxed", reward_mix=())
    try:
        assert type(empty_mix) is type(plain) and not isinstance(empty_mix, CombinedScorer)
        assert empty_mix.score_batch(responses, rows) == plain.score_batch(responses, rows)
    finally:
        plain.close()
        empty_mix.close()


# ------------------------------------------------------------------ metrics of a real producer batch


@pytest.mark.parametrize("environment", [None, "single_turn"])
def test_a_producer_logs_each_components_mean(plugin_file, environment):
    mix = (("boxed", 1.0), (f"{plugin_file}:length_bonus", 0.5))
    config = RLConfig(
        generation=GenerationConfig(num_generations=2, microbatch_size=2, max_new_tokens=8),
        reward=RewardConfig(mix=mix),
    )
    if environment is not None:
        config = replace(config, environment=EnvironmentConfig(name=environment, max_total_tokens=8))
    config = resolve(config).validate()
    scorer = build_reward_scorer(reward_mix=config.reward.mix, reward_timeout_s=30.0)
    try:
        metrics = Producer(0, config, reward_scorer=scorer).produce_chunk(0, [0, 1], seed_index=0).metrics
    finally:
        scorer.close()
    boxed, bonus = metrics["rollout/reward_boxed_mean"], metrics["rollout/reward_length_bonus_mean"]
    assert bonus > 0  # every response has some characters
    assert metrics["rollout/reward_mean"] == pytest.approx(1.0 * boxed + 0.5 * bonus, abs=1e-6)
    assert metrics["rollout/infra_error_fraction"] == 0.0


def test_without_a_mix_a_producer_logs_no_component_means():
    config = resolve(RLConfig(generation=GenerationConfig(num_generations=2, microbatch_size=2, max_new_tokens=8)))
    scorer = build_reward_scorer("boxed")
    try:
        metrics = Producer(0, config, reward_scorer=scorer).produce_chunk(0, [0], seed_index=0).metrics
    finally:
        scorer.close()
    assert [key for key in metrics if key.startswith("rollout/reward_")] == ["rollout/reward_mean"]
