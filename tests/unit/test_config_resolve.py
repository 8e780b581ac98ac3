"""``resolve``: the derived fields are the config's, filled in once, the same for the command line and for
``RLConfig(...)`` given to ``run_training``."""

from __future__ import annotations

from pathlib import Path

import pytest

from colossal_rl import presets
from colossal_rl.command_line import build_parser, config_from_args
from colossal_rl.config import (
    EMBEDDED_EVAL_DATA,
    TRUNCATED_IS_CAP,
    AlgorithmConfig,
    DataConfig,
    GenerationConfig,
    RewardConfig,
    RLConfig,
    RunConfig,
    ScheduleConfig,
)
from colossal_rl.config_resolve import resolve
from colossal_rl.presets import PRESETS


def cli(*argv: str) -> RLConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_the_default_config_resolves_to_the_command_lines_default():
    assert resolve(RLConfig()) == cli()


@pytest.mark.parametrize("name", PRESETS.names())
@pytest.mark.parametrize("n_behind", [0, 2])
def test_a_preset_in_the_config_resolves_as_the_flag_gives_it(name, n_behind):
    algorithm = PRESETS.get(name)(kl_coeff=0.05)  # DAPO and ONLINE_DPO keep 0 (the command line refuses -kl 0.05)
    programmatic = RLConfig(
        algorithm=algorithm,
        generation=GenerationConfig(max_new_tokens=64),
        schedule=ScheduleConfig(n_behind=n_behind),
    )
    argv = ("-a", name, "-kl", str(algorithm.kl_coeff), "-mnt", "64", "-nb", str(n_behind))
    assert resolve(programmatic) == cli(*argv)


def test_the_derived_fields_follow_the_fields_they_come_from():
    config = RLConfig(
        algorithm=presets.dapo(),
        data=DataConfig(train_path="train.jsonl"),
        generation=GenerationConfig(max_new_tokens=8192),
        reward=RewardConfig(reward_type="think_answer_tags"),
        run=RunConfig(seed=5),
        schedule=ScheduleConfig(n_behind=1),
    )
    resolved = resolve(config)
    assert resolved.data.seed == 47
    assert resolved.data.eval_paths == ()  # no default eval set for someone else's training set
    assert resolved.generation.stop_strings == ("</answer>",)
    assert resolved.algorithm.cache_length == 1024  # a quarter of 8192, at most 1024
    assert resolved.algorithm.truncated_is_cap == TRUNCATED_IS_CAP
    assert resolved == cli("-a", "DAPO", "-d", "train.jsonl", "-mnt", "8192", "-rt", "think_answer_tags", "--seed", "5")


def test_defaults_of_the_derived_fields():
    resolved = resolve(RLConfig(schedule=ScheduleConfig(n_behind=0)))
    assert resolved.data.seed == 42
    assert resolved.data.eval_paths == (("math", str(EMBEDDED_EVAL_DATA)),)
    assert resolved.generation.stop_strings == ()
    assert resolved.algorithm.cache_length == 0  # no soft punishment: no window
    assert resolved.algorithm.truncated_is_cap is None  # pi_old is the behaviour policy: nothing to correct


def test_explicit_values_are_kept():
    config = RLConfig(
        algorithm=AlgorithmConfig(soft_over_length_punishment=True, cache_length=3, truncated_is_cap=1.5),
        data=DataConfig(seed=7, eval_paths=(("gsm", "g.jsonl"),)),
        generation=GenerationConfig(stop_strings=("STOP",)),
        reward=RewardConfig(reward_type="think_answer_tags"),
        run=RunConfig(seed=100),
    )
    assert resolve(config) == config
    no_correction = AlgorithmConfig(truncated_is_when_behind=False)
    assert resolve(RLConfig(algorithm=no_correction)).algorithm.truncated_is_cap is None


@pytest.mark.parametrize(
    "config",
    [
        RLConfig(),
        RLConfig(algorithm=presets.dapo(), schedule=ScheduleConfig(n_behind=0), run=RunConfig(seed=3)),
        RLConfig(reward=RewardConfig(reward_type="think_answer_tags"), data=DataConfig(train_path="x.jsonl")),
    ],
)
def test_resolving_is_idempotent(config):
    once = resolve(config)
    assert resolve(once) == once
    assert once.data.seed is not None and once.data.eval_paths is not None
    assert once.generation.stop_strings is not None and once.algorithm.cache_length is not None


def test_a_config_file_value_wins_over_the_derived_one(tmp_path):
    from colossal_rl.command_line import parse_args

    path = tmp_path / "run.yaml"
    path.write_text("data:\n  seed: 3\ngeneration:\n  stop_strings: []\n", encoding="utf-8")
    config = config_from_args(parse_args(["--config", str(path), "-rt", "think_answer_tags", "--seed", "9"]))
    assert config.data.seed == 3 and config.generation.stop_strings == ()


def test_benchmarks_build_configs_from_the_package_not_the_script():
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    for script in benchmarks.glob("*.py"):
        text = script.read_text(encoding="utf-8")
        assert "from rl_example import" not in text and "import rl_example" not in text, script.name


@pytest.mark.parametrize(
    "mode, n_behind, max_staleness, corrected",
    [
        ("rounds", 0, 3, False),  # the round schedule's lag is -nb: --max-staleness is the stream's
        ("rounds", 1, 0, True),
        ("stream", 3, 0, False),  # the stream's lag is --max-staleness: -nb is the rounds'
        ("stream", 0, 1, True),
    ],
)
def test_every_derived_field_in_each_schedule_follows_that_schedules_lag(mode, n_behind, max_staleness, corrected):
    """Issue 45: each derived field gets a case in each schedule; only the truncated-IS cap depends on it (on the
    schedule's policy lag, exactly 0 or 1 behind), the others are the same in both."""
    schedule = ScheduleConfig(mode=mode, n_behind=n_behind, max_staleness=max_staleness)
    resolved = resolve(
        RLConfig(algorithm=presets.dapo(), generation=GenerationConfig(max_new_tokens=64), schedule=schedule)
    )
    assert resolved.algorithm.truncated_is_cap == (TRUNCATED_IS_CAP if corrected else None)
    assert resolved.algorithm.cache_length == 16  # a quarter of the response budget, whatever the schedule
    assert resolved.data.seed == 42 and resolved.data.eval_paths == (("math", str(EMBEDDED_EVAL_DATA)),)
    assert resolved.generation.stop_strings == ()
    assert resolve(resolved) == resolved
