"""The command line's flags -> a resolved run config: the parser, the checks of what the flags need from this
machine, and :func:`config_from_args`.

``rl_example.py`` runs it on ``sys.argv``; benchmarks and tests build configs from flag lists through it, so
they get exactly what a user gets. The flag table itself is ``flags.py``; the derived fields are
``config_resolve.py``'s. No algorithm logic here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from colossal_rl.config import AlgorithmConfig, ConfigError, RLConfig, replace
from colossal_rl.config_resolve import resolve
from colossal_rl.flags import FLAG_FIELDS, field_values, flag_defaults, flag_for

__all__ = ["FLAG_FIELDS", "NOT_CONFIG_FLAGS", "UsageError", "build_parser", "config_from_args", "parse_args"]


NOT_CONFIG_FLAGS = {"help", "no_wandb", "config", "print_config"}
"""Parser destinations that are not config fields (--no-wandb is an argument of run_training)."""


class UsageError(ValueError):
    """A flag has a value we cannot run with; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    """Every config flag from ``colossal_rl/flags.py`` (ColossalChat's names), plus --no-wandb, --config and --print-config."""
    from colossal_rl.config_fields import field_docs
    from colossal_rl.flags import add_flags

    p = argparse.ArgumentParser(
        description="Asynchronous GRPO/DAPO with Ray producers and ColossalAI consumers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p, field_docs())
    p.add_argument("--no-wandb", action="store_true", help="Write metrics.jsonl only.")
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML file with any part of the config tree (see --print-config); flags given here override it.",
    )
    p.add_argument("--print-config", action="store_true", help="Print the resolved config as YAML and exit.")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with a --config file's values as their defaults, so flags on the command line win over the
    file; the file's fields that no flag sets go to ``args.config_fields`` (applied by ``config_from_args``)."""
    from colossal_rl.config_files import ConfigFileError, flatten, read_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    config_file = pre.parse_known_args(argv)[0].config
    parser = build_parser()
    rest: dict = {}
    if config_file is not None:
        try:
            fields = flatten(read_config_file(config_file))
        except ConfigFileError as error:
            parser.error(str(error))
        defaults, rest = flag_defaults(fields)
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    args.config_fields = rest
    args.config_file_fields = set(fields) if config_file is not None else set()
    return args


def _check_flags_against_environment(args: argparse.Namespace) -> None:
    """Flags that depend on what is installed or reachable, checked before Ray starts."""
    _check_backend(args)
    _check_attention(args)
    _check_master_address(args)
    _check_weight_sync_backend(args)


def _check_attention(args: argparse.Namespace) -> None:
    """--attn-implementation flash_attention_2 needs the flash-attn package (checked without importing it)."""
    from importlib.util import find_spec

    if args.attn_implementation == "flash_attention_2" and find_spec("flash_attn") is None:
        raise UsageError(
            "--attn-implementation flash_attention_2 needs the flash-attn package (GPU only: "
            "pip install flash-attn --no-build-isolation); use sdpa otherwise"
        )


def _check_backend(args: argparse.Namespace) -> None:
    """-ptp > 1 needs -b vllm. (-b vllm's own environment is found or built when the run starts.)"""
    if args.backend != "vllm" and args.producer_tensor_parallel_size > 1:
        raise UsageError("-ptp/--producer-tensor-parallel-size > 1 needs -b vllm (tensor-parallel producers)")


def _check_weight_sync_backend(args: argparse.Namespace) -> None:
    """--weight-sync-backend ray_nccl needs cupy (checked without importing it); GPUs are checked at launch."""
    import importlib.util

    if args.weight_sync_backend == "ray_nccl" and importlib.util.find_spec("cupy") is None:
        raise UsageError(
            "--weight-sync-backend ray_nccl: Ray's NCCL collectives need cupy, which is not installed "
            '(pip install -e ".[gpu]"), or use --weight-sync-backend torch'
        )


def _check_master_address(args: argparse.Namespace) -> None:
    """--master-address must map to a Ray address (host, host:port, auto or ray://...) before Ray starts."""
    if args.master_address is None:
        return
    from colossal_rl.ray_address import ray_address

    try:
        ray_address(args.master_address)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _eval_paths(args: argparse.Namespace) -> dict[str, str] | None:
    """-ed's JSON map; None without -ed (``resolve`` derives the eval sets from the training set)."""
    if args.eval_dataset is None:
        return None
    try:
        mapping = json.loads(args.eval_dataset)
    except json.JSONDecodeError as error:
        raise UsageError(f'-ed/--eval-dataset must be a JSON map like {{"task": "path.jsonl"}}: {error}') from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise UsageError("-ed/--eval-dataset must be a JSON map of task name to dataset source")
    return mapping


def _preset_algorithm(preset: Callable[..., AlgorithmConfig], kl_coeff: float) -> AlgorithmConfig:
    """The preset given -kl; a -kl the preset drops (DAPO and ONLINE_DPO have no KL term) is refused, not ignored.

    Every preset's KL coefficient is -kl's default (0), so a preset that sets another one was given a -kl on
    purpose (by the flag or a --config file); running without the penalty asked for would look like a run with it.
    """
    algorithm = preset(kl_coeff=kl_coeff)
    if algorithm.kl_coeff != kl_coeff:
        raise ConfigError(
            "algorithm.kl_coeff", f"-a {algorithm.name} has no KL term, so it would ignore {kl_coeff}; leave -kl out"
        )
    return algorithm


def config_from_args(args: argparse.Namespace) -> RLConfig:
    """The resolved, validated run config: the algorithm preset (-a, given -kl, which it must keep), then every
    other flag's field, then the fields a --config file sets without a flag, then :func:`resolve` (the derived
    fields); errors name the flag."""
    from colossal_rl.config_files import ConfigFileError, apply_fields
    from colossal_rl.presets import PRESETS

    _check_flags_against_environment(args)
    try:
        values = field_values(args)
        preset = PRESETS.get(values.pop("algorithm.name"))
        algorithm = _preset_algorithm(preset, values.pop("algorithm.kl_coeff"))
        values["data.eval_paths"] = _eval_paths(args)
        config = apply_fields(replace(RLConfig(), algorithm=algorithm), values)
        if getattr(args, "config_fields", None):
            config = apply_fields(config, args.config_fields, str(args.config))
        return resolve(config).validate()
    except ConfigError as error:
        flag = flag_for(error.field_path)
        if error.field_path in getattr(args, "config_file_fields", ()):  # set in the --config file (or by the flag)
            flag = f"{args.config}: {error.field_path} / {flag}"
        raise UsageError(f"{flag}: {error.message}") from None
    except ConfigFileError as error:
        raise UsageError(str(error)) from None
