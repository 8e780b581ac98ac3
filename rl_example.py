"""Command line of colossal-rl: ColossalChat's ``rl_example.py`` flags -> RLConfig -> launch.

    python rl_example.py                  # GRPO on the embedded tiny model, offline, on CPU
    python rl_example.py -m Qwen/Qwen2.5-0.5B -d data.jsonl -lr 1e-6 -mnt 1024 ...

Only this file parses argv (flags -> config: ``colossal_rl/command_line.py``). No algorithm logic here.
"""

from __future__ import annotations

import logging
import sys

from colossal_rl.command_line import (
    FLAG_FIELDS,
    NOT_CONFIG_FLAGS,
    UsageError,
    build_parser,
    config_from_args,
    parse_args,
)

logger = logging.getLogger("colossal_rl")

__all__ = ["FLAG_FIELDS", "NOT_CONFIG_FLAGS", "UsageError", "build_parser", "config_from_args", "main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    from colossal_rl.data import DataError
    from colossal_rl.driver.calls import RunFailed
    from colossal_rl.driver.launch import run_training
    from colossal_rl.driver.placement import PlacementError
    from colossal_rl.input_checks import InputError
    from colossal_rl.producer_env import ProducerEnvError
    from colossal_rl.run_checkpoints.on_disk import CheckpointError
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
