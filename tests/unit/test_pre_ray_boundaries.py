"""The checks made before Ray starts, exactly at their limits: a value equal to the limit is allowed, one past it is
refused naming the field or flag. A token budget exactly the model's context (``input_checks.check_episode_fits_vllm``,
for a text model and a vision-language one's text config) or exactly vLLM's ``--max-model-len``
(``RLConfig.validate``); batch sizes exactly equal (inference micro-batch and batch; a step's samples and the
training micro-batch; pipeline micro-batches and ``-pp``); a staleness bound exactly ``sync_every_steps - 1``;
closed ranges at their ends; a training set of exactly one round or one optimizer step (``plan_schedule``), and
``--max-steps`` exactly a whole number of rounds.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from colossal_rl.config import (
    ConfigError,
    DataConfig,
    EnvironmentConfig,
    GenerationConfig,
    ParallelConfig,
    RLConfig,
    ScheduleConfig,
    TrainConfig,
    VllmEngineConfig,
)
from colossal_rl.config_resolve import resolve
from colossal_rl.data import DataError
from colossal_rl.driver.schedules import plan_schedule
from colossal_rl.input_checks import InputError, check_episode_fits_vllm
from colossal_rl.rollout.vllm_backend import max_model_len
from colossal_rl.schedule.streaming import staleness_bound_problem

EMBEDDED_CONTEXT = 256  # the embedded model's max_position_embeddings
TOOL_BUDGET = 96  # --max-total-tokens


def episode_config(max_prompt_tokens: int, model: str | None = None) -> RLConfig:
    config = resolve(
        RLConfig(
            generation=GenerationConfig(num_generations=2, microbatch_size=2, max_new_tokens=8, backend="vllm"),
            environment=EnvironmentConfig(name="calculator", max_turns=3, max_total_tokens=TOOL_BUDGET),
            data=DataConfig(max_prompt_tokens=max_prompt_tokens),
        )
    )
    return config if model is None else replace(config, model=replace(config.model, path=model))


def test_an_episode_exactly_the_models_context_fits_and_one_token_more_is_refused():
    check_episode_fits_vllm(episode_config(EMBEDDED_CONTEXT - TOOL_BUDGET))
    with pytest.raises(InputError, match=r"161 \+ 96 = 257 tokens.* context of 256") as refused:
        check_episode_fits_vllm(episode_config(EMBEDDED_CONTEXT - TOOL_BUDGET + 1))
    assert "-mpt/--max-prompt-tokens" in str(refused.value)


def test_a_vision_language_models_text_context_bounds_an_episode_exactly(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2_5_vl", "text_config": {"max_position_embeddings": 300}, "vision_config": {}})
    )
    check_episode_fits_vllm(episode_config(300 - TOOL_BUDGET, str(tmp_path)))
    with pytest.raises(InputError, match="context of 300"):
        check_episode_fits_vllm(episode_config(300 - TOOL_BUDGET + 1, str(tmp_path)))


def with_vllm_max_model_len(config: RLConfig, length: int) -> RLConfig:
    return replace(config, generation=replace(config.generation, vllm=VllmEngineConfig(max_model_len=length)))


@pytest.mark.parametrize("environment", [None, "calculator"])
def test_a_max_model_len_exactly_the_sequence_budget_is_valid_and_one_less_is_refused(environment):
    config = episode_config(128)
    if environment is None:
        config = replace(config, environment=EnvironmentConfig())
    budget = config.max_sequence_tokens
    assert budget == 128 + (TOOL_BUDGET if environment else 8)
    with_vllm_max_model_len(config, budget).validate()
    with pytest.raises(ConfigError, match=rf"generation.vllm.max_model_len.*= {budget}"):
        with_vllm_max_model_len(config, budget - 1).validate()
    check_episode_fits_vllm(with_vllm_max_model_len(config, budget))  # a configured length: validate's to check


def test_the_engine_length_of_a_budget_exactly_the_models_context_is_that_context():
    assert max_model_len(None, EMBEDDED_CONTEXT, EMBEDDED_CONTEXT) == EMBEDDED_CONTEXT
    assert max_model_len(None, EMBEDDED_CONTEXT - 1, EMBEDDED_CONTEXT) == EMBEDDED_CONTEXT - 1
    assert max_model_len(None, EMBEDDED_CONTEXT + 1, EMBEDDED_CONTEXT) == EMBEDDED_CONTEXT


def sized(**fields) -> RLConfig:
    """1 trainer, 2 producers; ``fields``: generation/train/schedule/parallel overrides."""
    return resolve(
        RLConfig(
            generation=GenerationConfig(**{"num_generations": 2, "microbatch_size": 4, **fields.get("generation", {})}),
            train=TrainConfig(
                **{"batch_size": 4, "minibatch_size": 4, "microbatch_size": 2, **fields.get("train", {})}
            ),
            parallel=ParallelConfig(**{"num_trainers": 1, **fields.get("parallel", {})}),
            schedule=ScheduleConfig(**{"num_producers": 2, "inference_batch_size": 4, **fields.get("schedule", {})}),
        )
    )


@pytest.mark.parametrize(
    ("at_limit", "past_limit", "field"),
    [
        (  # an inference micro-batch exactly the inference batch
            {"generation": {"microbatch_size": 4}},
            {"generation": {"microbatch_size": 5}},
            "generation.microbatch_size",
        ),
        (  # a training micro-batch exactly a step's minibatch x generations
            {"train": {"microbatch_size": 8}},
            {"train": {"microbatch_size": 9}},
            "train.microbatch_size",
        ),
    ],
)
def test_batch_sizes_exactly_at_their_limit_are_valid(at_limit, past_limit, field):
    sized(**at_limit).validate()
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        sized(**past_limit).validate()


def test_a_step_split_into_exactly_pp_pipeline_micro_batches_is_valid():
    """A step's 8 samples (4 prompts x 2) in micro-batches of tmbs // pp: exactly pp of them with -tmbs 8 (the most
    a step's samples allow: fewer micro-batches than pp cannot be asked for)."""
    for pp_size in (2, 4):
        pipeline = {"num_trainers": pp_size, "pp_size": pp_size, "precision": "bf16"}
        sized(parallel=pipeline, train={"microbatch_size": 8, "sequence_layout": "padded"}).validate()


@pytest.mark.parametrize("sync_every_steps", [1, 2, 5])
def test_a_staleness_bound_exactly_sync_every_steps_minus_1_holds(sync_every_steps):
    assert staleness_bound_problem(sync_every_steps - 1, sync_every_steps) is None
    if sync_every_steps > 1:
        assert "must be >= sync_every_steps - 1" in staleness_bound_problem(sync_every_steps - 2, sync_every_steps)


@pytest.mark.parametrize(
    ("section", "field", "at_end", "past_end"),
    [
        ("generation", "top_p", 1.0, 1.01),
        ("vllm", "gpu_memory_utilization", 1.0, 1.01),
        ("train", "min_lr_ratio", 1.0, 1.01),
        ("train", "min_lr_ratio", 0.0, -0.01),
        ("reward", "max_infra_error_fraction", 1.0, 1.01),
        ("reward", "max_infra_error_fraction", 0.0, -0.01),
        ("algorithm", "filter_range", (0.0, 1.0), (0.0, 1.01)),
        ("algorithm", "filter_range", (0.5, 0.5), (0.5, 0.49)),
        ("data", "min_pixels", 1024, 1025),  # against max_pixels 1024
    ],
)
def test_closed_ranges_take_their_ends(section, field, at_end, past_end):
    def config_with(value) -> RLConfig:
        base = resolve(RLConfig(data=DataConfig(max_pixels=1024)))
        if section == "vllm":
            return replace(base, generation=replace(base.generation, vllm=VllmEngineConfig(**{field: value})))
        current = getattr(base, section)
        return replace(base, **{section: replace(current, **{field: value})})

    config_with(at_end).validate()
    with pytest.raises(ConfigError, match=field):
        config_with(past_end).validate()


def test_a_training_set_of_exactly_one_round_plans_one_round():
    config = sized()  # a round: 2 producers x 4 prompts
    plan = plan_schedule(config, 8)
    assert (plan.rounds, plan.total_steps) == (1, config.optimizer_steps_per_round)
    with pytest.raises(DataError, match="7 prompts, fewer than one round needs"):
        plan_schedule(config, 7)


def test_a_training_set_of_exactly_one_step_plans_one_stream_step():
    config = sized(schedule={"mode": "stream", "max_staleness": 1})  # a step: 4 groups
    assert plan_schedule(config, 4).total_steps == 1
    with pytest.raises(DataError, match="3 prompts, fewer than one optimizer step"):
        plan_schedule(config, 3)


def test_max_steps_exactly_whole_rounds_plans_those_rounds_and_one_more_step_a_round_more():
    per_round = sized().optimizer_steps_per_round
    exact = sized(schedule={"max_steps": 2 * per_round})
    assert plan_schedule(exact, 80).rounds == 2 and plan_schedule(exact, 80).total_steps == 2 * per_round
    over = sized(schedule={"max_steps": 2 * per_round + 1})
    assert plan_schedule(over, 80).rounds == 3
    stream = sized(schedule={"mode": "stream", "max_staleness": 1, "max_steps": 20})
    assert plan_schedule(stream, 80).total_steps == 20  # exactly the episode's steps: all of them
    assert plan_schedule(replace(stream, schedule=replace(stream.schedule, max_steps=21)), 80).total_steps == 20
