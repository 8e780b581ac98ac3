"""Every command-line flag, declared once: its names (ColossalChat's) and the config field it sets.

A flag's long name is dashed (``--ray-dir``); ColossalChat's underscore spellings (``--ray_dir``,
``--master_address``, ``--master_port``, ``--enable_profiling``) stay accepted as hidden aliases, so its
command lines keep working while help lists one spelling per flag.

Everything else about a flag is derived from the field in ``config.py``: the type (int, float, str; ``X | None``
takes X), the default (``RLConfig()``'s value), the choices (the field's ``Literal``), the help (the field's
docstring, unless the flag says it better). ``command_line.py`` builds argparse from this table, maps parsed
values back to fields (:func:`field_values`) and names the flag in errors (:func:`flag_for`). Flags that act
outside the config (``--no-wandb``, ``--config``, ``--print-config``) are added by ``command_line.py`` itself.
This module only maps flags to fields: presets and derived fields are ``presets.py``'s and ``config_resolve.py``'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colossal_rl.config import DEPRECATED_VALUES, RLConfig
from colossal_rl.config_fields import field_annotation, field_value, literal_choices, unwrap_optional


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    field: str
    """Dotted path of the config field the flag sets (``train.learning_rate``)."""
    help: str | None = None
    """None: the field's docstring."""
    dest: str | None = None
    """argparse destination; None: argparse's own (from the first long name)."""
    kind: str = "value"
    """``value``; ``switch`` (store_true for a False field); ``off_switch`` (store_false for a True field,
    e.g. --no-final-export); ``toggle`` (--x / --no-x); ``inverse_switch`` (store_true that sets the field
    False, e.g. --full-logits)."""
    choices: tuple[str, ...] | None = None
    """None: the field's Literal values (if any)."""
    type: Callable[[str], Any] | None = None
    """None: from the field's annotation."""
    aliases: tuple[str, ...] = ()
    """Other spellings accepted but left out of help (ColossalChat's ``--ray_dir`` for ``--ray-dir``)."""

    @property
    def destination(self) -> str:
        if self.dest is not None:
            return self.dest
        long = next(name for name in self.names if name.startswith("--"))
        return long[2:].replace("-", "_")


def parse_reward_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``--reward-mix boxed=1,my_rewards.py:brevity=0.2`` -> ``(("boxed", 1.0), ("my_rewards.py:brevity", 0.2))``;
    ``""``: no mix. A malformed item raises ArgumentTypeError naming it (argparse names the flag)."""
    return tuple(_mix_item(item) for item in filter(None, (part.strip() for part in text.split(","))))


def _mix_item(item: str) -> tuple[str, float]:
    spec, _, weight = item.rpartition("=")
    try:
        if spec.strip():
            return spec.strip(), float(weight)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"bad item {item!r}: expected SPEC=WEIGHT[,SPEC=WEIGHT...], e.g. boxed=1,my_rewards.py:brevity=0.2"
    )


def _algorithm_names() -> tuple[str, ...]:
    from colossal_rl.presets import PRESETS

    return tuple(PRESETS.names())


FLAGS: tuple[Flag, ...] = (
    # model and data
    Flag(("-m", "--model"), "model.path"),
    Flag(("--trust-remote-code",), "model.trust_remote_code", kind="switch"),
    Flag(("--routing-replay",), "model.routing_replay", kind="switch"),
    Flag(("--router-aux-loss-coef",), "train.router_aux_loss_coef"),
    Flag(
        ("-d", "--dataset"),
        "data.train_path",
        "Training prompts: jsonl, json, parquet, a saved datasets directory[@split] or a hub name[@split].",
    ),
    Flag(
        ("-ed", "--eval-dataset"),
        "data.eval_paths",
        'JSON map {"task": "source"} (same kinds of source as -d); default: the embedded eval set with the '
        "embedded training set, none otherwise.",
        type=str,
    ),
    Flag(("-s", "--system-prompt"), "data.system_prompt"),
    Flag(("-mpt", "--max-prompt-tokens"), "data.max_prompt_tokens"),
    Flag(("--prompt-key",), "data.prompt_key"),
    Flag(("--answer-key",), "data.answer_key"),
    Flag(("--image-key",), "data.image_key"),
    Flag(("--min-pixels",), "data.min_pixels"),
    Flag(("--max-pixels",), "data.max_pixels"),
    Flag(("--limit-images",), "data.limit_images"),
    # generation
    Flag(
        ("-b", "--backend"),
        "generation.backend",
        "Producer inference engine; vllm runs in the producers' own environment.",
    ),
    Flag(("-g", "--num-generations"), "generation.num_generations"),
    Flag(("-temp", "--temperature"), "generation.temperature"),
    Flag(("-topk", "--top-k"), "generation.top_k"),
    Flag(("-topp", "--top-p"), "generation.top_p"),
    Flag(("-mnt", "--max-new-tokens"), "generation.max_new_tokens"),
    Flag(("-imbs", "--inference-microbatch-size"), "generation.microbatch_size"),
    Flag(("-ptp", "--producer-tensor-parallel-size"), "generation.tensor_parallel_size"),
    Flag(("--eval-temperature",), "generation.eval_temperature"),
    Flag(("--eval-samples",), "generation.eval_samples"),
    Flag(("--gpu-memory-utilization",), "generation.vllm.gpu_memory_utilization"),
    Flag(("--enforce-eager",), "generation.vllm.enforce_eager", kind="toggle"),
    Flag(("--enable-chunked-prefill",), "generation.vllm.enable_chunked_prefill", kind="toggle"),
    Flag(("--max-model-len",), "generation.vllm.max_model_len"),
    Flag(("--block-size",), "generation.vllm.block_size"),
    Flag(("--vllm-weight-receive",), "generation.vllm.weight_receive"),
    # algorithm
    Flag(("-a", "--algo"), "algorithm.name", "Algorithm preset (colossal_rl/presets.py).", type=str.upper),
    Flag(("-kl", "--kl-coeff"), "algorithm.kl_coeff"),
    Flag(("--old-logprobs",), "algorithm.old_logprobs"),
    Flag(("--dpo-beta",), "algorithm.dpo_beta"),
    # training
    Flag(("-lr", "--learning-rate"), "train.learning_rate"),
    Flag(("-tbs", "--train-batch-size"), "train.batch_size"),
    Flag(("-tMbs", "--train-minibatch-size"), "train.minibatch_size"),
    Flag(("-tmbs", "--train-microbatch-size"), "train.microbatch_size"),
    Flag(("--warmup-steps",), "train.warmup_steps"),
    Flag(("--lr-schedule",), "train.lr_schedule"),
    Flag(("--min-lr-ratio",), "train.min_lr_ratio"),
    Flag(("--ppo-epochs",), "train.ppo_epochs"),
    Flag(("--grad-checkpoint",), "train.gradient_checkpointing", kind="switch"),
    Flag(("--attn-implementation",), "train.attn_implementation"),
    Flag(
        ("--full-logits",),
        "train.logits_from_hidden",
        "Compute log-probs from full [tokens, vocabulary] logits instead of from hidden states in chunks.",
        kind="inverse_switch",
    ),
    Flag(("--sequence-layout",), "train.sequence_layout"),
    Flag(("--max-tokens-per-microbatch",), "train.max_tokens_per_microbatch"),
    Flag(("--lora-rank",), "train.lora_rank"),
    Flag(("--lora-alpha",), "train.lora_alpha"),
    Flag(("--lora-target-modules",), "train.lora_target_modules"),
    Flag(("--freeze-vision-tower",), "train.freeze_vision_tower", kind="switch"),
    # parallelism and schedule
    Flag(("-t", "--num-trainers"), "parallel.num_trainers"),
    Flag(("-tp", "--tensor-parallel-size"), "parallel.tp_size"),
    Flag(("-pp", "--pipeline-parallel-size"), "parallel.pp_size"),
    Flag(("-zero", "--zero-stage"), "parallel.zero_stage"),
    Flag(("--precision",), "parallel.precision"),
    Flag(("--trainer-backend",), "parallel.trainer_backend"),
    Flag(("-i", "--num-inferencer"), "schedule.num_producers"),
    Flag(("-ibs", "--inference-batch-size"), "schedule.inference_batch_size"),
    Flag(("-e", "--num-episodes"), "schedule.num_episodes"),
    Flag(("-nb", "--n-behind"), "schedule.n_behind"),
    Flag(("--max-steps",), "schedule.max_steps"),
    Flag(("--schedule",), "schedule.mode"),
    Flag(("--max-staleness",), "schedule.max_staleness"),
    Flag(("--sync-every-steps",), "schedule.sync_every_steps"),
    Flag(("--continuous-batching",), "generation.continuous_batching", kind="switch"),
    Flag(("--partial-rollouts",), "generation.partial_rollouts", kind="switch"),
    # reward
    Flag(("-rt", "--reward-type"), "reward.reward_type"),
    Flag(
        ("--reward-fn",),
        "reward.reward_fn",
        "User reward plug-in path/to/file.py:function or module:function (loaded and called on one row with "
        "an empty response before Ray starts).",
    ),
    Flag(
        ("--reward-mix",),
        "reward.mix",
        "A weighted sum of named rewards, SPEC=WEIGHT[,SPEC=WEIGHT...] (e.g. boxed=1,my_rewards.py:brevity=0.2): a "
        "SPEC is a reward type or a plug-in file.py:function / module:function; each is logged as "
        "rollout/reward_<name>_mean (name: the type or the function). The first one's correctness is the sample's "
        "(rollout/accuracy): list the verifiable reward first. Replaces --reward-fn.",
        type=parse_reward_mix,
    ),
    Flag(("-cv", "--code-verifier-url"), "reward.code_verifier_url"),
    Flag(("--reward-timeout",), "reward.reward_timeout_s"),
    Flag(("--max-infra-error-fraction",), "reward.max_infra_error_fraction"),
    Flag(("--reward-model",), "reward.reward_model"),
    Flag(("--reward-actors",), "reward.reward_actors"),
    Flag(("--reward-normalisation",), "reward.reward_normalisation"),
    Flag(("--reward-batch-size",), "reward.reward_batch_size"),
    Flag(("--judge-template",), "reward.judge_template"),
    Flag(("--judge-rule",), "reward.judge_rule"),
    Flag(("--judge-url",), "reward.judge_url"),
    Flag(("--judge-model",), "reward.judge_model"),
    Flag(("--judge-token-file",), "reward.judge_token_file"),
    Flag(("--judge-concurrency",), "reward.judge_concurrency"),
    # environments (multi-turn rollouts)
    Flag(("--env",), "environment.name"),
    Flag(("--max-turns",), "environment.max_turns"),
    Flag(("--max-total-tokens",), "environment.max_total_tokens"),
    # run
    Flag(("-p", "--project"), "run.project"),
    Flag(("-sd", "--save-dir"), "run.save_dir"),
    Flag(("-ei", "--eval-interval"), "run.eval_interval"),
    Flag(("-esd", "--eval-save-dir"), "run.eval_save_dir"),
    Flag(("--overwrite-eval-dir",), "run.overwrite_eval_dir", kind="switch"),
    Flag(("-rsd", "--rollout-save-dir"), "run.rollout_save_dir"),
    Flag(("--log-rollout-interval",), "run.log_rollout_interval"),
    Flag(("--enable-profiling",), "run.enable_profiling", kind="switch", aliases=("--enable_profiling",)),
    Flag(("-si", "--save-interval"), "run.save_interval"),
    Flag(("--save-limit",), "run.save_limit"),
    Flag(("--no-final-export",), "run.final_export", dest="final_export", kind="off_switch"),
    Flag(("-cp", "--checkpoint-path"), "run.checkpoint_path"),
    Flag(("--resume-fallback",), "run.resume_fallback", kind="switch"),
    Flag(("--seed",), "run.seed"),
    Flag(("--timeout",), "run.timeout_s"),
    Flag(("--max-actor-restarts",), "run.max_actor_restarts"),
    Flag(("--producer-threads",), "run.producer_threads"),
    Flag(("--trainer-threads",), "run.trainer_threads"),
    Flag(("--weight-sync-backend",), "run.weight_sync_backend"),
    Flag(("--weight-sync-mode",), "run.weight_sync_mode"),
    Flag(("--ray-dir",), "run.ray_dir", aliases=("--ray_dir",)),
    Flag(("--master-address",), "run.master_address", aliases=("--master_address",)),
    Flag(("--master-port",), "run.master_port", aliases=("--master_port",)),
)

FLAG_FIELDS: dict[str, str] = {flag.destination: flag.field for flag in FLAGS}
"""argparse destination -> the config field it sets."""


def _value_type(annotation: Any) -> tuple[Callable[[str], Any] | None, tuple[str, ...] | None]:
    """(argparse type, choices) for a field annotation: ``X | None`` -> X; Literal -> str with its values."""
    annotation, _ = unwrap_optional(annotation)
    choices = literal_choices(annotation)
    if choices is not None:
        return str, choices
    if annotation in (int, float, str):
        return annotation, None
    raise TypeError(f"no flag type for {annotation!r}")


def add_flags(parser: argparse.ArgumentParser, docs: dict[str, str]) -> None:
    """One argparse argument per :data:`FLAGS` entry (type, default, choices, help derived from the field)."""
    defaults = RLConfig()
    for flag in FLAGS:
        help_text = (flag.help or docs.get(flag.field, "")).replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"help": help_text}
        if flag.dest is not None:
            kwargs["dest"] = flag.dest
        if flag.kind in ("switch", "inverse_switch"):
            kwargs["action"] = "store_true"
        elif flag.kind == "off_switch":
            kwargs["action"] = "store_false"
        elif flag.kind == "toggle":
            kwargs |= {"action": argparse.BooleanOptionalAction, "default": field_value(defaults, flag.field)}
        else:
            value_type, choices = (flag.type, None) if flag.type else _value_type(field_annotation(flag.field))
            if flag.field == "algorithm.name":
                choices = _algorithm_names()
            kwargs["type"] = value_type
            if flag.choices or choices:
                shown = list(flag.choices or choices or ())
                kwargs["choices"] = shown + list(DEPRECATED_VALUES.get(flag.field, {}))  # old values: accepted
                if len(kwargs["choices"]) > len(shown):  # but not offered
                    kwargs["metavar"] = "{" + ",".join(shown) + "}"
            kwargs["default"] = field_value(defaults, flag.field)
        parser.add_argument(*flag.names, **kwargs)
        if flag.aliases:  # the same argument under other names: sets the same destination, no default of its own
            hidden = {"dest": flag.destination, "help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
            parser.add_argument(*flag.aliases, **(kwargs | hidden))


def field_values(args: argparse.Namespace) -> dict[str, Any]:
    """Config field -> the value its flag parsed to (``inverse_switch`` flags negated)."""
    return {
        flag.field: (not getattr(args, flag.destination))
        if flag.kind == "inverse_switch"
        else getattr(args, flag.destination)
        for flag in FLAGS
    }


def flag_defaults(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Config-file fields split into (argparse defaults of the flags that set them, fields no flag sets): the
    inverse of :func:`field_values`, so flags given on the command line still win over the file."""
    import json

    by_field = {flag.field: flag for flag in FLAGS}
    defaults: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for field, value in fields.items():
        flag = by_field.get(field)
        if flag is None:
            rest[field] = value
        elif flag.field == "data.eval_paths":  # -ed takes a JSON map
            defaults[flag.destination] = None if value is None else json.dumps(value)
        else:
            defaults[flag.destination] = (not value) if flag.kind == "inverse_switch" else value
    return defaults, rest


def flag_for(field_path: str) -> str:
    """How the user types the flag of a config field (``-lr/--learning-rate``), or the field path itself."""
    for flag in FLAGS:
        if flag.field == field_path:
            return "/".join(flag.names)
    return field_path
