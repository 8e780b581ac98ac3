"""``--trainer-backend auto`` resolves before Ray starts, by what each environment's transformers knows; a model
neither environment knows, or a backend that cannot take it, is refused in one line naming the flag and the model."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from colossal_rl.config import EMBEDDED_MODEL_DIR, ConfigError, ModelConfig, ParallelConfig, RLConfig
from colossal_rl.driver import trainer_backend
from colossal_rl.input_checks import InputError

PRODUCERS = ("5.19.0", frozenset({"qwen2", "olmo3", "glm4_moe"}))


def ask_producers():
    return PRODUCERS


def never_ask():
    pytest.fail("the producers' environment was asked about a model the trainers know")


def model_dir(tmp_path, model_type: str, **extra) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **extra}))
    return str(tmp_path)


def config_for(path: str, backend: str = "auto", **parallel) -> RLConfig:
    return RLConfig(model=ModelConfig(path=path), parallel=ParallelConfig(trainer_backend=backend, **parallel))


def test_the_trainers_transformers_is_read_from_its_source_without_torch():
    version, types = trainer_backend.trainers_model_types()
    assert version == "4.51.3"
    assert {"qwen2", "qwen3_moe", "qwen2_5_vl", "llama"} <= types
    assert not {"olmo3", "glm4_moe", "gpt_oss", "qwen3_5"} & types  # the model types of the last 20 months


def test_a_model_the_trainers_know_trains_on_colossalai(caplog):
    with caplog.at_level(logging.INFO, logger=trainer_backend.__name__):
        config = trainer_backend.resolve_trainer_backend(config_for(str(EMBEDDED_MODEL_DIR)), ask_producers=never_ask)
    assert config.parallel.trainer_backend == "colossalai"
    assert "model type qwen2 is known to transformers 4.51.3" in caplog.text


def test_a_model_only_the_producers_know_trains_on_fsdp2_and_says_why(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=trainer_backend.__name__):
        config = trainer_backend.resolve_trainer_backend(
            config_for(model_dir(tmp_path, "olmo3")), ask_producers=ask_producers
        )
    assert config.parallel.trainer_backend == "fsdp2"
    [line] = [record.getMessage() for record in caplog.records]
    assert "fsdp2" in line and "olmo3" in line and "4.51.3" in line and "5.19.0" in line


def test_colossalai_asked_for_a_model_it_cannot_load_is_refused_naming_the_way_out(tmp_path):
    with pytest.raises(InputError, match=r"--trainer-backend colossalai: model type 'glm4_moe'.*fsdp2"):
        trainer_backend.resolve_trainer_backend(
            config_for(model_dir(tmp_path, "glm4_moe"), "colossalai"), ask_producers=ask_producers
        )


def test_a_model_neither_environment_knows_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"model type 'brand_new' .* known neither"):
        trainer_backend.resolve_trainer_backend(
            config_for(model_dir(tmp_path, "brand_new")), ask_producers=ask_producers
        )


def test_own_code_models_stay_on_colossalai(tmp_path):
    path = model_dir(tmp_path, "brand_new", auto_map={"AutoModelForCausalLM": "modeling.Model"})
    config = dataclasses.replace(config_for(path), model=ModelConfig(path=path, trust_remote_code=True))
    assert trainer_backend.resolve_trainer_backend(config, ask_producers=never_ask).parallel.trainer_backend == (
        "colossalai"
    )


@pytest.mark.parametrize(
    ("parallel", "field"),
    [({"pp_size": 2, "num_trainers": 2}, "parallel.pp_size"), ({"zero_stage": 1}, "parallel.zero_stage"),
     ({"tp_size": 2, "num_trainers": 2}, "parallel.tp_size"), ({"precision": "fp16"}, "parallel.precision")],
)  # fmt: skip
def test_auto_choosing_fsdp2_still_refuses_what_fsdp2_cannot_do_naming_the_flag(tmp_path, parallel, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        trainer_backend.resolve_trainer_backend(config_for(model_dir(tmp_path, "olmo3"), **parallel),
                                                ask_producers=ask_producers)  # fmt: skip


def test_routing_replay_is_refused_on_fsdp2_in_one_line(tmp_path):
    path = model_dir(tmp_path, "qwen3_moe", num_experts=8)
    config = dataclasses.replace(config_for(path, "fsdp2"), model=ModelConfig(path=path, routing_replay=True))
    with pytest.raises(InputError, match=r"--routing-replay: .*fsdp2"):
        trainer_backend.resolve_trainer_backend(config, ask_producers=never_ask)


def test_a_vision_language_model_is_refused_on_fsdp2_in_one_line(tmp_path):
    config = config_for(model_dir(tmp_path, "qwen2_5_vl", vision_config={"depth": 2}), "fsdp2")
    with pytest.raises(InputError, match=r"--trainer-backend fsdp2: .* vision-language model"):
        trainer_backend.resolve_trainer_backend(config, ask_producers=never_ask)


def test_a_trainer_built_outside_a_run_with_auto_takes_colossalai_where_installed_else_fsdp2(monkeypatch):
    """``engine_name`` (a trainer built from a config that never went through the driver): this environment has
    ColossalAI, so ``auto`` is colossalai; where it is not installed (the producers' environment) it is fsdp2. A
    concrete choice is kept either way."""
    import importlib.util

    from colossal_rl.training.engines import engine_name

    assert importlib.util.find_spec("colossalai") is not None
    assert engine_name(config_for(str(EMBEDDED_MODEL_DIR))) == "colossalai"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "colossalai" else
                        real_find_spec(name, *a))  # fmt: skip
    assert engine_name(config_for(str(EMBEDDED_MODEL_DIR))) == "fsdp2"
    assert engine_name(config_for(str(EMBEDDED_MODEL_DIR), "colossalai")) == "colossalai"
