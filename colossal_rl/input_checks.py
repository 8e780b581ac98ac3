"""What a run reads, checked before Ray starts, so that a mistake costs seconds and one line naming it.

Datasets parse (each row with what the reward needs), the model is a local directory or a hub name that
is cached or reachable, and every reward plug-in (``--reward-fn``, ``--reward-mix``) loads and scores one row.
The training set is read here once; its size is what the driver plans its rounds with. Torch-free: the driver
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from colossal_rl.config import PACKED_VISION_UNDER_FLASH_ATTENTION, RLConfig


class InputError(ValueError):
    """A model, dataset or reward plug-in the run cannot use; the message names the flag or file."""


@dataclass(frozen=True)
class CheckedInputs:
    train_rows: int
    """Rows of the training source (before over-long prompts are left out by the producers' tokenizer)."""


def check_inputs(config: RLConfig) -> CheckedInputs:
    """Raise :class:`InputError` (or ``data_sources.DataError`` naming file and line) for the first bad input."""
    from colossal_rl.data_sources import RowKeys, load_prompt_rows

    keys = RowKeys.for_config(config)
    train_rows = load_prompt_rows(config.data.train_path, keys)
    sources = {config.data.train_path: train_rows}
    for _, path in config.data.eval_paths:
        sources[path] = load_prompt_rows(path, keys)
    check_model(config.model.path)
    check_images(config, sources, model_is_vision_language(config.model.path))
    check_mixture_of_experts(config)
    plugins = [("--reward-fn", config.reward.reward_fn)] if config.reward.reward_fn is not None else []
    plugins += [("--reward-mix", spec) for spec in config.reward.mix_plugins]
    for flag, spec in plugins:
        check_reward_plugin(spec, train_rows[0], config.data.train_path, config.reward.reward_timeout_s, flag=flag)
    if config.environment.name is not None:
        check_environment_spec(config, train_rows[0])
        check_episode_fits_vllm(config)
    return CheckedInputs(train_rows=len(train_rows))


def check_model(model: str) -> None:
    """A local directory with a config.json, or a hub name in the local cache or on a reachable hub."""
    looks_local = model.startswith((".", "/", "~")) or Path(model).exists() or model.count("/") != 1
    if looks_local:
        if not (Path(model).expanduser() / "config.json").is_file():
            raise InputError(f"-m/--model: no model directory with a config.json at {model!r}")
        return
    from huggingface_hub import try_to_load_from_cache

    from colossal_rl.data_sources import hub_reachable

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return  # cached: loads offline
    if not hub_reachable():
        raise InputError(
            f"-m/--model: {model!r} is not a local directory, not in the Hugging Face cache, and the hub is not "
            "reachable (download it where there is network, or give a local path)"
        )


def model_config_json(model: str) -> dict | None:
    """The model's config.json (local, or in the hub cache) as a dict; None if unreadable here (the producers' and
    trainers' own loads then say why)."""
    import json

    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def check_mixture_of_experts(config: RLConfig) -> None:
    """A mixture-of-experts policy only where it can train, routing replay only where it can record
    (``moe/support.py``)."""
    from colossal_rl.moe.support import moe_refusal

    refusal = moe_refusal(
        model_config_json(config.model.path),
        model=config.model.path,
        tp_size=config.parallel.tp_size,
        pp_size=config.parallel.pp_size,
        routing_replay=config.model.routing_replay,
        backend=config.generation.backend,
        continuous_batching=config.generation.continuous_batching,
        environment=config.environment.name,
        router_aux_loss_coef=config.train.router_aux_loss_coef,
        lora_rank=config.train.lora_rank,
    )
    if refusal is not None:
        raise InputError(refusal)


def model_is_vision_language(model: str) -> bool:
    """Whether the model's config.json has a ``vision_config``; False if unreadable here."""
    loaded = model_config_json(model)
    return loaded is not None and loaded.get("vision_config") is not None


def check_images(config: RLConfig, sources: dict[str, list[dict]], vision_language: bool) -> None:
    """Images only with a vision-language model, and only where it can train; every image file a row names exists."""
    from colossal_rl.data import source_directory

    key = config.data.image_key
    parallel = config.parallel
    if not vision_language:
        if config.train.freeze_vision_tower:
            raise InputError(f"--freeze-vision-tower: -m/--model {config.model.path} has no vision tower")
        for source, rows in sources.items():
            for number, row in enumerate(rows, 1):
                if row.get(key):
                    raise InputError(
                        f"{source} row {number} has images (--image-key {key}) but -m/--model {config.model.path} is "
                        "a text-only model: use a vision-language model (Qwen2.5-VL), or drop the column"
                    )
        return
    if config.generation.continuous_batching:
        raise InputError(
            f"--continuous-batching: -m/--model {config.model.path} is a vision-language model; continuous batching "
            "decodes text-only models (leave out --continuous-batching)"
        )
    if parallel.tp_size > 1 or parallel.pp_size > 1:
        raise InputError(
            f"-m/--model {config.model.path} is a vision-language model: it trains under DDP and ZeRO only "
            "(ColossalAI 0.5.0 has no tensor/pipeline shard policy for Qwen2.5-VL); drop -tp/-pp"
        )
    if config.train.sequence_layout == "packed" and config.train.attn_implementation == "flash_attention_2":
        raise InputError(
            f"--sequence-layout packed: -m/--model {config.model.path}: {PACKED_VISION_UNDER_FLASH_ATTENTION}"
        )
    for source, rows in sources.items():
        base = source_directory(source)
        for number, row in enumerate(rows, 1):
            values = row.get(key) or []
            for index, value in enumerate(values if isinstance(values, list | tuple) else [values]):
                if isinstance(value, str) and not _resolve(value, base).is_file():
                    raise InputError(f"{source} row {number}: {key}[{index}] {value!r}: no such image file")


def _resolve(path: str, base: Path) -> Path:
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else base / candidate


def check_reward_plugin(spec: str, row: dict, source: str, timeout_s: float, flag: str = "--reward-fn") -> None:
    """The plug-in loads, has the right signature, and scores one training row (an empty response) without
    raising, within ``timeout_s`` (in a worker process, as in the run): the user's own code, checked here so a
    mistake costs seconds instead of a run of infra errors."""
    from colossal_rl.reward.user_functions import PluginScorer, RewardConfigError, load_reward_fn

    try:
        function = load_reward_fn(spec)
    except RewardConfigError as error:
        raise InputError(f"{flag}: {error}") from None
    scorer = PluginScorer(function, spec, timeout_s=timeout_s, num_workers=1)
    try:
        record = scorer.score_batch([""], [row])[0]
    finally:
        scorer.close()
    if record.status == "infra_error":
        raise InputError(
            f"{flag} {spec!r}: scoring an empty response to the first row of {source} failed: "
            f"{record.details.get('error')}"
        )


def check_environment_spec(config: RLConfig, row: dict) -> None:
    """``--env`` names a registered environment or a plug-in class that opens an episode on the first training
    row (its constructor gets a context without a reward scorer here: nothing is scored before Ray starts)."""
    from colossal_rl.environments import EnvironmentConfigError, EnvironmentContext, check_environment
    from colossal_rl.prompts import system_prompt_for

    if model_is_vision_language(config.model.path):
        raise InputError(f"--env: multi-turn rollouts take text-only models; {config.model.path} has a vision tower")
    context = EnvironmentContext(
        reward_scorer=None, system_prompt=system_prompt_for(config.reward.reward_type, config.data.system_prompt)
    )
    try:
        check_environment(config.environment.name, row, context)
    except EnvironmentConfigError as error:
        raise InputError(f"{error} (first row of {config.data.train_path})") from None


def check_episode_fits_vllm(config: RLConfig) -> None:
    """``--env`` with ``-b vllm``: an episode's sequence (-mpt + --max-total-tokens) must fit the model's context.

    A single-turn vLLM engine is sized to ``min(-mpt + -mnt, the model's context)``; an episode grows turn by turn
    towards -mpt + --max-total-tokens, and a turn past the engine's ``max_model_len`` would fail mid-run.
    """
    if config.generation.backend != "vllm" or config.generation.vllm.max_model_len is not None:
        return  # the transformers backend has no engine length; a configured max_model_len is checked by validate()
    loaded = model_config_json(config.model.path) or {}
    context = (loaded.get("text_config") or {}).get("max_position_embeddings") or loaded.get("max_position_embeddings")
    if isinstance(context, int) and config.max_sequence_tokens > context:
        raise InputError(
            f"--env with -b vllm: an episode may reach -mpt + --max-total-tokens = {config.data.max_prompt_tokens} + "
            f"{config.environment.max_total_tokens} = {config.max_sequence_tokens} tokens, more than "
            f"{config.model.path}'s context of {context}; lower -mpt/--max-prompt-tokens (the longest prompt, tools "
            "included) or --max-total-tokens"
        )
