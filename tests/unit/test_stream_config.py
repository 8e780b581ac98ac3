"""``--schedule stream``'s flags reach the config, and what stream mode does not run yet fails in one line that
names the flag, before Ray starts (``RLConfig._validate_stream``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rl_example.py is a script at the repo root

from rl_example import UsageError, config_from_args, parse_args  # noqa: E402

STREAM = ["--schedule", "stream"]
PARTIAL = [*STREAM, "--continuous-batching", "--partial-rollouts"]


def config_of(argv: list[str]):
    return config_from_args(parse_args(argv))


def test_defaults_keep_the_round_schedule():
    schedule = config_of([]).schedule
    assert (schedule.mode, schedule.max_staleness, schedule.sync_every_steps) == ("rounds", 1, 1)


def test_stream_flags_reach_the_schedule_config():
    schedule = config_of([*STREAM, "--max-staleness", "3", "--sync-every-steps", "2"]).schedule
    assert (schedule.mode, schedule.max_staleness, schedule.sync_every_steps) == ("stream", 3, 2)
    assert schedule.policy_lag == 3


def test_stream_staleness_sets_the_truncated_importance_cap_as_n_behind_does():
    assert config_of([*STREAM, "--max-staleness", "0", "-nb", "1"]).algorithm.truncated_is_cap is None
    assert config_of([*STREAM, "--max-staleness", "1", "-nb", "0"]).algorithm.truncated_is_cap is not None


def test_unknown_schedule_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        parse_args(["--schedule", "continuous"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-staleness", "-1"], "^--max-staleness: must be >= 0$"),
        (["--sync-every-steps", "0"], "^--sync-every-steps: must be >= 1$"),
        (
            [*STREAM, "--sync-every-steps", "3"],
            r"^--max-staleness: must be >= sync_every_steps - 1 = 2, got 1: .* \(stream mode\)",
        ),
        ([*STREAM, "-pp", "2", "-t", "2"], "^--schedule: stream does not support pipeline parallelism yet"),
        ([*STREAM, "--ppo-epochs", "2"], "^--schedule: stream does not support several passes"),
        (["--continuous-batching"], "^--continuous-batching: continuous batching feeds the stream schedule"),
        ([*STREAM, "--continuous-batching", "--env", "calculator"], "^--continuous-batching: decodes single-turn"),
        (
            ["--continuous-batching", "--partial-rollouts"],
            "^--partial-rollouts: loads weights mid-response .*: add --schedule stream$",
        ),
        (
            [*STREAM, "--partial-rollouts"],
            "^--partial-rollouts: pauses the continuous-batching engine at a sync: add --continuous-batching$",
        ),
        ([*PARTIAL, "--env", "calculator"], "^--partial-rollouts: continues single-turn responses"),
    ],
)
def test_unsupported_or_bad_stream_settings_fail_in_one_line_naming_the_flag(argv, message):
    with pytest.raises(UsageError, match=message) as failure:
        config_of(argv)
    assert "\n" not in str(failure.value)


def test_partial_rollouts_reach_the_generation_config_and_default_off():
    assert config_of(PARTIAL).generation.partial_rollouts
    assert config_of([*PARTIAL, "-b", "vllm"]).generation.partial_rollouts  # vLLM's engine takes them too
    assert not config_of([*STREAM, "--continuous-batching"]).generation.partial_rollouts


def test_the_round_schedule_ignores_the_stream_only_limits():
    config = config_of(["-pp", "2", "-t", "2", "--ppo-epochs", "2", "-si", "1", "--sync-every-steps", "3"])
    assert config.schedule.mode == "rounds"


def test_continuous_batching_streams_one_prompt_a_chunk_with_twice_the_engine_slots_ordered():
    from colossal_rl.driver.actor_groups import producer_concurrency
    from colossal_rl.driver.schedules import stream_settings

    config = config_of([*STREAM, "--continuous-batching", "-imbs", "4"])
    assert config.generation.continuous_batching
    settings = stream_settings(config, total_steps=3)
    assert (settings.prompts_per_chunk, settings.chunks_in_flight_per_producer) == (1, 8)
    assert producer_concurrency(config) == 8 + 4
    batched = stream_settings(config_of([*STREAM, "-imbs", "4"]), total_steps=3)
    assert (batched.prompts_per_chunk, batched.chunks_in_flight_per_producer) == (4, 2)


def test_continuous_batching_takes_either_backend():
    """vLLM's engine is fed prompt by prompt (``rollout/vllm_continuous.py``): the same chunks and concurrency."""
    from colossal_rl.driver.actor_groups import producer_concurrency

    config = config_of([*STREAM, "--continuous-batching", "-b", "vllm", "-imbs", "4"])
    assert (config.generation.backend, config.generation.continuous_batching) == ("vllm", True)
    assert producer_concurrency(config) == 8 + 4
