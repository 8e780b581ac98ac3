"""``--trainer-backend auto`` resolved before Ray starts: ColossalAI where its transformers knows the model, else FSDP2.

The trainers' environment pins transformers 4.51.3 (ColossalAI 0.5.0's); the producers' environment has today's. A
model's ``model_type`` (its config.json) decides: ``colossalai`` when 4.51.3 knows it (or the model brings its own
code), else ``fsdp2`` when the producers' transformers knows it; a model neither knows is refused in one line. The
choice and its reason are said in one INFO line and kept in the run's ``config.yaml``. Nothing here imports torch: the
trainers' transformers is read from its source (its ``CONFIG_MAPPING_NAMES`` literal), the producers' by asking their
interpreter.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import logging
import subprocess
from functools import cache
from pathlib import Path

from colossal_rl.config import RLConfig
from colossal_rl.input_checks import InputError, model_config_json

logger = logging.getLogger(__name__)

_ASK_PRODUCERS = (
    "import json; from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as names; "
    "import transformers; print(json.dumps([transformers.__version__, sorted(names)]))"
)


@cache
def trainers_model_types() -> tuple[str, frozenset[str]]:
    """(version, model types) of this environment's transformers, read from its source without importing it."""
    from importlib.metadata import version

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return "none", frozenset()
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / "auto" / "configuration_auto.py"
    return version("transformers"), frozenset(mapping_names(source.read_text()))


def mapping_names(source: str) -> list[str]:
    """The keys of the ``CONFIG_MAPPING_NAMES`` literal in transformers' ``configuration_auto.py`` source."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "CONFIG_MAPPING_NAMES" for target in node.targets
        ):
            return [
                element.elts[0].value
                for element in ast.walk(node.value)
                if isinstance(element, ast.Tuple) and element.elts and isinstance(element.elts[0], ast.Constant)
            ]
    raise ValueError("transformers' configuration_auto.py has no CONFIG_MAPPING_NAMES literal")


@cache
def producers_model_types(python: str, timeout_s: float = 120.0) -> tuple[str, frozenset[str]]:
    """(version, model types) of the transformers in the producers' environment at ``python``."""
    done = subprocess.run([python, "-c", _ASK_PRODUCERS], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise InputError(f"asking the producers' environment ({python}) for its model types failed: {lines[-1:]}")
    version, names = json.loads(done.stdout.strip().splitlines()[-1])
    return version, frozenset(names)


def producers_python() -> str:
    from colossal_rl.producer_env import ensure_producer_env

    return str(ensure_producer_env())  # built on first use (minutes; its progress is logged)


def resolve_trainer_backend(config: RLConfig, *, ask_producers=None) -> RLConfig:
    """``config`` with ``parallel.trainer_backend`` concrete, or :class:`InputError` naming the model and what knows
    it. ``ask_producers``: () -> (version, model types) of the producers' transformers (default: ask its interpreter;
    only called when the trainers' transformers does not know the model)."""
    model_json = model_config_json(config.model.path) or {}
    model_type = model_json.get("model_type")
    chosen = config.parallel.trainer_backend
    own_code = config.model.trust_remote_code and "auto_map" in model_json
    trainers_version, trainers_types = trainers_model_types()
    if model_type is None or own_code or model_type in trainers_types:
        if chosen == "auto":
            why = "brings its own code" if own_code else f"is known to transformers {trainers_version}"
            logger.info("trainer backend colossalai (--trainer-backend auto): model type %s %s", model_type, why)
            chosen = "colossalai"
        return _with_backend(config, chosen, model_json)
    producers_version, producers_types = (ask_producers or (lambda: producers_model_types(producers_python())))()
    if model_type not in producers_types:
        raise InputError(
            f"-m/--model: model type {model_type!r} ({config.model.path}) is known neither to the colossalai "
            f"trainers' transformers {trainers_version} nor to the producers' {producers_version}: no trainer can "
            "load it (a model with its own code needs --trust-remote-code)"
        )
    if chosen == "colossalai":
        raise InputError(
            f"--trainer-backend colossalai: model type {model_type!r} ({config.model.path}) is unknown to "
            f"transformers {trainers_version}, the newest ColossalAI 0.5.0 runs with; use --trainer-backend fsdp2 "
            f"(transformers {producers_version} knows it) or auto"
        )
    if chosen == "auto":
        logger.info(
            "trainer backend fsdp2 (--trainer-backend auto): model type %s is unknown to the colossalai trainers' "
            "transformers %s and known to the producers' environment's %s",
            model_type,
            trainers_version,
            producers_version,
        )
    return _with_backend(config, "fsdp2", model_json)


def _with_backend(config: RLConfig, backend: str, model_json: dict) -> RLConfig:
    if backend == "fsdp2" and model_json.get("vision_config") is not None:
        raise InputError(
            f"--trainer-backend fsdp2: {config.model.path} is a vision-language model, whose image features the "
            "trainer embeds outside the model's forward, where FSDP2's parameters are still sharded: train it on "
            "--trainer-backend colossalai"
        )
    if backend == "fsdp2" and config.model.routing_replay:
        raise InputError(
            "--routing-replay: replay hooks the Qwen3-MoE blocks of transformers 4.51.3 (the colossalai trainers'); "
            "fsdp2 trainers and their producers run today's transformers, whose MoE blocks differ: drop "
            "--routing-replay (an MoE policy trains on fsdp2 without it) or use --trainer-backend colossalai"
        )
    parallel = dataclasses.replace(config.parallel, trainer_backend=backend)
    parallel.validate()  # fsdp2's refusals (-pp, -zero, fp16) name the flag
    return dataclasses.replace(config, parallel=parallel)
