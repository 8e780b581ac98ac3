"""rl_example.py's training flags (issues 16 and 17): each reaches its config field, bad values name the flag."""

import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root, not part of the package

from rl_example import UsageError, build_parser, config_from_args  # noqa: E402


def config_for(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_defaults():
    config = config_for()
    assert config.algorithm.old_logprobs == "recompute"
    assert config.train.ppo_epochs == 1
    assert config.train.gradient_checkpointing is False
    assert config.train.attn_implementation == "sdpa"
    assert config.train.logits_from_hidden is True


def test_each_flag_reaches_its_field():
    config = config_for(
        "--old-logprobs", "behaviour", "--ppo-epochs", "3", "--grad-checkpoint", "--attn-implementation", "eager",
        "--full-logits", "-tbs", "4", "-tMbs", "2", "-tmbs", "4", "-a", "DAPO",
    )  # fmt: skip
    assert config.algorithm.old_logprobs == "behaviour"
    assert config.algorithm.name == "DAPO"  # the preset is kept, only pi_old changes
    assert config.algorithm.clip_eps_high == 0.28
    assert config.train.ppo_epochs == 3
    assert config.train.gradient_checkpointing is True
    assert config.train.attn_implementation == "eager"
    assert config.train.logits_from_hidden is False
    assert config.train.minibatch_size == 2
    assert config.optimizer_steps_per_round == 3 * config.steps_per_round == 3 * 4


def test_bad_ppo_epochs_names_the_flag():
    with pytest.raises(UsageError, match="--ppo-epochs: must be >= 1"):
        config_for("--ppo-epochs", "0")


@pytest.mark.skipif(find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_the_package_names_the_flag():
    with pytest.raises(UsageError, match="--attn-implementation flash_attention_2 needs the flash-attn package"):
        config_for("--attn-implementation", "flash_attention_2")
