"""Command line of colossal-rl: ColossalChat's ``rl_example.py`` flags -> RLConfig -> launch.

    python rl_example.py                  # GRPO on the embedded tiny model, offline, on CPU
    python rl_example.py -m Qwen/Qwen2.5-0.5B -d data.jsonl -lr 1e-6 -mnt 1024 ...

Only this file parses argv. No algorithm logic here.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from colossal_rl.config import EMBEDDED_EVAL_DATA, ConfigError, DataConfig, RLConfig, replace
from colossal_rl.flags import FLAG_FIELDS, field_values, flag_defaults, flag_for

logger = logging.getLogger("colossal_rl")

NOT_CONFIG_FLAGS = {"help", "no_wandb", "config", "print_config"}
"""Parser destinations that are not config fields (--no-wandb is an argument of run_training)."""

__all__ = ["FLAG_FIELDS", "NOT_CONFIG_FLAGS", "UsageError", "build_parser", "config_from_args", "main", "parse_args"]


class UsageError(ValueError):
    """A flag has a value we cannot run with; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    """Every config flag from ``colossal_rl/flags.py`` (ColossalChat's names), plus the flags of this script."""
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
    """--master_address must map to a Ray address (host, host:port, auto or ray://...) before Ray starts."""
    if args.master_address is None:
        return
    from colossal_rl.placement import ray_address

    try:
        ray_address(args.master_address)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _eval_paths(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    if args.eval_dataset is None:
        return (("math", str(EMBEDDED_EVAL_DATA)),) if args.dataset == DataConfig().train_path else ()
    try:
        mapping = json.loads(args.eval_dataset)
    except json.JSONDecodeError as error:
        raise UsageError(f'-ed/--eval-dataset must be a JSON map like {{"task": "path.jsonl"}}: {error}') from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise UsageError("-ed/--eval-dataset must be a JSON map of task name to dataset source")
    return tuple(mapping.items())


def config_from_args(args: argparse.Namespace) -> RLConfig:
    """Build and validate the run config: the algorithm preset (-a), then every flag's field, then the fields
    derived from others and those a --config file sets without a flag; errors name the flag."""
    from colossal_rl.config_files import ConfigFileError, apply_fields
    from colossal_rl.presets import algorithm_preset

    _check_flags_against_environment(args)
    try:
        values = field_values(args)
        del values["algorithm.kl_coeff"]  # the preset decides what to make of it (DAPO drops the KL term)
        algorithm = algorithm_preset(
            values.pop("algorithm.name"),
            kl_coeff=args.kl_coeff,
            max_new_tokens=args.max_new_tokens,
            n_behind=args.n_behind,
        )
        values["data.eval_paths"] = dict(_eval_paths(args))
        config = apply_fields(replace(RLConfig(), algorithm=algorithm), values)
        derived = {
            "data.seed": args.seed + 42,
            "generation.stop_strings": ["</answer>"] if args.reward_type == "think_answer_tags" else [],
        }
        config = apply_fields(config, derived)
        if getattr(args, "config_fields", None):
            config = apply_fields(config, args.config_fields, str(args.config))
        return config.validate()
    except ConfigError as error:
        flag = flag_for(error.field_path)
        if error.field_path in getattr(args, "config_file_fields", ()):  # set in the --config file (or by the flag)
            flag = f"{args.config}: {error.field_path} / {flag}"
        raise UsageError(f"{flag}: {error.message}") from None
    except ConfigFileError as error:
        raise UsageError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    from colossal_rl.actor_groups import RunFailed
    from colossal_rl.data import DataError
    from colossal_rl.input_checks import InputError
    from colossal_rl.launch import run_training
    from colossal_rl.placement import PlacementError
    from colossal_rl.producer_env import ProducerEnvError
    from colossal_rl.run_checkpoint import CheckpointError
    from colossal_rl.run_outputs import OutputDirError

    try:
        config = config_from_args(args)
        if args.print_config:
            from colossal_rl.config_files import config_to_yaml

            sys.stdout.write(config_to_yaml(config))
            return 0
        summary = run_training(config, use_wandb=not args.no_wandb)
    except (
        UsageError,
        InputError,
        DataError,
        RunFailed,
        CheckpointError,
        OutputDirError,
        PlacementError,
        ProducerEnvError,
    ) as error:
        logger.error("%s", error)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted; actors were shut down")
        return 130
    logger.info(
        "done: %d optimizer steps in %.0fs; eval accuracy %s -> %s; run directory %s%s",
        summary.steps,
        summary.wall_time_s,
        summary.eval_accuracy_before,
        summary.eval_accuracy_after,
        summary.run_dir,
        f"; trained model {summary.final_model_dir}" if summary.final_model_dir else "",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
