"""The config as YAML: round trip, --config with flags overriding it, --print-config, errors naming file and field."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from colossal_rl.config import AlgorithmConfig, DataConfig, GenerationConfig, RLConfig, TrainConfig
from colossal_rl.config_files import ConfigFileError, config_to_yaml, load_config_file

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root, not part of the package

from rl_example import UsageError, config_from_args, main, parse_args  # noqa: E402


def _non_default_config() -> RLConfig:
    return RLConfig(
        data=DataConfig(eval_paths=(("gsm8k", "a.jsonl"), ("math500", "b.parquet")), system_prompt="Think."),
        generation=GenerationConfig(top_k=20, stop_strings=("</answer>",), eval_temperature=0.6, eval_samples=4),
        algorithm=AlgorithmConfig(name="DAPO", clip_eps_high=0.28, truncated_is_cap=2.0),
        train=TrainConfig(learning_rate=1e-6, lr_schedule="cosine", min_lr_ratio=0.1, weight_decay=0.01),
    ).validate()


def test_config_to_yaml_and_back_is_the_same_config(tmp_path):
    config = _non_default_config()
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(config))
    assert load_config_file(path) == config


def test_a_partial_file_changes_only_what_it_names(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  learning_rate: 1.0e-5\nschedule:\n  num_episodes: 3\n")
    config = load_config_file(path)
    assert config == dataclasses.replace(
        RLConfig(),
        train=dataclasses.replace(RLConfig().train, learning_rate=1e-5),
        schedule=dataclasses.replace(RLConfig().schedule, num_episodes=3),
    )


def _cli(tmp_path, text: str, *flags: str) -> RLConfig:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return config_from_args(parse_args(["--config", str(path), *flags]))


def test_the_file_sets_flag_and_flagless_fields_and_flags_on_the_command_line_win(tmp_path):
    text = (
        "algorithm:\n  name: DAPO\n  clip_eps_high: 0.3\n"
        "train:\n  learning_rate: 1.0e-5\n  weight_decay: 0.05\n  lr_schedule: cosine\n"
        "data:\n  eval_paths: {gsm8k: g.jsonl}\n"
    )
    config = _cli(tmp_path, text)
    assert config.algorithm.name == "DAPO" and config.algorithm.clip_eps_high == 0.3  # preset, then the file's field
    assert config.train.learning_rate == 1e-5 and config.train.weight_decay == 0.05
    assert config.train.lr_schedule == "cosine" and config.data.eval_paths == (("gsm8k", "g.jsonl"),)
    overridden = _cli(tmp_path, text, "-lr", "3e-5", "--lr-schedule", "constant")
    assert overridden.train.learning_rate == 3e-5 and overridden.train.lr_schedule == "constant"
    assert overridden.train.weight_decay == 0.05


def test_print_config_output_is_a_config_file_for_the_same_run(tmp_path, capsys):
    flags = ["-lr", "1e-5", "-g", "4", "--eval-temperature", "0.7", "--eval-samples", "2", "-a", "DAPO"]
    assert main([*flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert config_from_args(parse_args(["--config", str(path)])) == config_from_args(parse_args(flags))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  learnign_rate: 1.0\n", "train.learnign_rate: no such field (train has: learning_rate,"),
        ("trian:\n  learning_rate: 1.0\n", "trian: no such field (the config has: model, data,"),
        ("train:\n  weight_decay: lots\n", "train.weight_decay: expected float, got 'lots'"),
        (
            "train:\n  lr_schedule: linear\n",
            "train.lr_schedule / --lr-schedule: must be one of constant, cosine, got 'linear'",
        ),
        ("train:\n  learning_rate:\n    value: 1\n", "train.learning_rate: not a section"),
        ("train: 3\n", "train: is a section; give its fields"),
    ],
)
def test_bad_fields_name_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises((ConfigFileError, UsageError)) as caught:
        config_from_args(parse_args(["--config", str(path)]))
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)


def test_a_bad_value_in_the_file_names_file_field_and_flag(tmp_path):
    with pytest.raises(UsageError) as caught:
        _cli(tmp_path, "train:\n  warmup_steps: -5\n")
    assert str(caught.value) == f"{tmp_path / 'run.yaml'}: train.warmup_steps / --warmup-steps: must be >= 0, got -5"


@pytest.mark.parametrize(
    ("text", "message"),
    [("train:\n  lr: [1\n", "run.yaml:3: invalid YAML"), ("- 1\n- 2\n", "a config file is a mapping of sections")],
)
def test_unreadable_files_stop_the_parser_naming_the_file(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as caught:
        parse_args(["--config", str(path)])
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_every_example_config_is_a_valid_config():
    examples = sorted((REPO_ROOT / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        config = config_from_args(parse_args(["--config", str(path)]))
        assert config.data.prompt_key == "problem" or path.name != "grpo_qwen2.5_math.yaml"
        assert load_config_file(path).train.learning_rate == config.train.learning_rate
