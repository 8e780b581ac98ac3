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

from colossal_rl.config import (
    EMBEDDED_EVAL_DATA,
    LR_SCHEDULE_NAMES,
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    GenerationConfig,
    ModelConfig,
    ParallelConfig,
    RewardConfig,
    RLConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    VllmEngineConfig,
    replace,
)

logger = logging.getLogger("colossal_rl")

# Flag destination -> the config field it sets: the one table of which flag owns which field. Flag names for
# errors (``flag_for``) and the --config merge are derived from it and from the parser.
FLAG_FIELDS = {
    "model": "model.path",
    "trust_remote_code": "model.trust_remote_code",
    "dataset": "data.train_path",
    "eval_dataset": "data.eval_paths",
    "system_prompt": "data.system_prompt",
    "max_prompt_tokens": "data.max_prompt_tokens",
    "prompt_key": "data.prompt_key",
    "answer_key": "data.answer_key",
    "backend": "generation.backend",
    "num_generations": "generation.num_generations",
    "temperature": "generation.temperature",
    "top_k": "generation.top_k",
    "top_p": "generation.top_p",
    "max_new_tokens": "generation.max_new_tokens",
    "inference_microbatch_size": "generation.microbatch_size",
    "producer_tensor_parallel_size": "generation.tensor_parallel_size",
    "eval_temperature": "generation.eval_temperature",
    "eval_samples": "generation.eval_samples",
    "gpu_memory_utilization": "generation.vllm.gpu_memory_utilization",
    "enforce_eager": "generation.vllm.enforce_eager",
    "enable_chunked_prefill": "generation.vllm.enable_chunked_prefill",
    "max_model_len": "generation.vllm.max_model_len",
    "algo": "algorithm.name",
    "kl_coeff": "algorithm.kl_coeff",
    "old_logprobs": "algorithm.old_logprobs",
    "learning_rate": "train.learning_rate",
    "train_batch_size": "train.batch_size",
    "train_minibatch_size": "train.minibatch_size",
    "train_microbatch_size": "train.microbatch_size",
    "warmup_steps": "train.warmup_steps",
    "lr_schedule": "train.lr_schedule",
    "min_lr_ratio": "train.min_lr_ratio",
    "ppo_epochs": "train.ppo_epochs",
    "grad_checkpoint": "train.gradient_checkpointing",
    "attn_implementation": "train.attn_implementation",
    "full_logits": "train.logits_from_hidden",
    "sequence_layout": "train.sequence_layout",
    "max_tokens_per_microbatch": "train.max_tokens_per_microbatch",
    "num_trainers": "parallel.num_trainers",
    "tensor_parallel_size": "parallel.tp_size",
    "pipeline_parallel_size": "parallel.pp_size",
    "zero_stage": "parallel.zero_stage",
    "precision": "parallel.precision",
    "num_inferencer": "schedule.num_producers",
    "inference_batch_size": "schedule.inference_batch_size",
    "num_episodes": "schedule.num_episodes",
    "n_behind": "schedule.n_behind",
    "max_steps": "schedule.max_steps",
    "reward_type": "reward.reward_type",
    "reward_fn": "reward.reward_fn",
    "code_verifier_url": "reward.code_verifier_url",
    "max_infra_error_fraction": "reward.max_infra_error_fraction",
    "project": "run.project",
    "save_dir": "run.save_dir",
    "eval_interval": "run.eval_interval",
    "eval_save_dir": "run.eval_save_dir",
    "overwrite_eval_dir": "run.overwrite_eval_dir",
    "rollout_save_dir": "run.rollout_save_dir",
    "log_rollout_interval": "run.log_rollout_interval",
    "enable_profiling": "run.enable_profiling",
    "save_interval": "run.save_interval",
    "save_limit": "run.save_limit",
    "final_export": "run.final_export",
    "checkpoint_path": "run.checkpoint_path",
    "seed": "run.seed",
    "timeout": "run.timeout_s",
    "producer_threads": "run.producer_threads",
    "trainer_threads": "run.trainer_threads",
    "weight_sync_backend": "run.weight_sync_backend",
    "ray_dir": "run.ray_dir",
    "master_address": "run.master_address",
    "master_port": "run.master_port",
}
NEGATED_FLAGS = {"full_logits"}
"""Flags that set their field to the opposite of their value (--full-logits: logits_from_hidden False)."""
NOT_CONFIG_FLAGS = {"help", "no_wandb", "config", "print_config"}
"""Parser destinations that are not config fields (--no-wandb is an argument of run_training)."""


def flag_for(field_path: str) -> str:
    """The flag(s) that set a config field, as the user types them (``-lr/--learning-rate``), or the field."""
    dests = {field: dest for dest, field in FLAG_FIELDS.items()}
    if field_path not in dests:
        return field_path
    for action in build_parser()._actions:
        if action.dest == dests[field_path]:
            return "/".join(action.option_strings)
    return field_path


class UsageError(ValueError):
    """A flag has a value we cannot run with; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    defaults = RLConfig()
    p = argparse.ArgumentParser(
        description="Asynchronous GRPO/DAPO with Ray producers and ColossalAI consumers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-m", "--model", default=defaults.model.path, help="HF hub name or local model directory.")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Run the model's own code (auto_map in its config) when loading it, its tokenizer and config.",
    )
    p.add_argument("-cp", "--checkpoint-path", default=None, help="Resume from this checkpoint directory.")
    p.add_argument(
        "-d",
        "--dataset",
        default=defaults.data.train_path,
        help="Training prompts: jsonl, json, parquet, a saved datasets directory[@split] or a hub name[@split].",
    )
    p.add_argument("-ed", "--eval-dataset", default=None, help='JSON map {"task": "path.jsonl"}; default: embedded.')
    p.add_argument("-p", "--project", default=defaults.run.project, help="Project / run name.")
    p.add_argument("-e", "--num-episodes", type=int, default=defaults.schedule.num_episodes)
    p.add_argument("-t", "--num-trainers", type=int, default=defaults.parallel.num_trainers)
    p.add_argument("-i", "--num-inferencer", type=int, default=defaults.schedule.num_producers)
    p.add_argument("-g", "--num-generations", type=int, default=defaults.generation.num_generations)
    p.add_argument(
        "-ibs",
        "--inference-batch-size",
        type=int,
        default=defaults.schedule.inference_batch_size,
        help="Prompts each producer generates per round.",
    )
    p.add_argument("-imbs", "--inference-microbatch-size", type=int, default=defaults.generation.microbatch_size)
    p.add_argument(
        "-tbs",
        "--train-batch-size",
        type=int,
        default=defaults.train.batch_size,
        help="Prompts per optimizer step per data-parallel rank.",
    )
    p.add_argument("-tMbs", "--train-minibatch-size", type=int, default=defaults.train.minibatch_size)
    p.add_argument(
        "-tmbs",
        "--train-microbatch-size",
        type=int,
        default=defaults.train.microbatch_size,
        help="Samples per forward/backward pass.",
    )
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("-zero", "--zero-stage", type=int, default=0)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=defaults.parallel.precision)
    p.add_argument("--ray_dir", default=None, help="Ray temporary directory.")
    p.add_argument(
        "--master_address",
        default=None,
        help="Join the Ray cluster whose head is here: host (port 6379), host:port, auto or ray://host:port.",
    )
    p.add_argument(
        "--master_port",
        type=int,
        default=defaults.run.master_port,
        help="Trainers' process-group port; default: a free port locally, 29506 on a --master_address cluster.",
    )
    p.add_argument(
        "-b",
        "--backend",
        default="transformers",
        choices=["transformers", "vllm"],
        help='Producer inference engine; vllm needs GPUs and pip install -e ".[gpu]".',
    )
    p.add_argument("-temp", "--temperature", type=float, default=defaults.generation.temperature)
    p.add_argument("-topk", "--top-k", type=int, default=None)
    p.add_argument("-topp", "--top-p", type=float, default=defaults.generation.top_p)
    p.add_argument("-s", "--system-prompt", default=None, help="Default: the reward type's system prompt.")
    p.add_argument("-mnt", "--max-new-tokens", type=int, default=defaults.generation.max_new_tokens)
    p.add_argument(
        "-mpt",
        "--max-prompt-tokens",
        type=int,
        default=defaults.data.max_prompt_tokens,
        help="Prompts longer than this (tokens, after the chat template) are left out, with a logged count.",
    )
    p.add_argument(
        "--prompt-key",
        default=defaults.data.prompt_key,
        help="Dataset column holding the prompt: a string, a message object or a list of messages.",
    )
    p.add_argument(
        "--answer-key",
        default=defaults.data.answer_key,
        help="Dataset column holding the reference answer (e.g. solution), read as gt_answer.",
    )
    p.add_argument(
        "-ptp", "--producer-tensor-parallel-size", type=int, default=1, help="GPUs per producer (-b vllm only)."
    )
    vllm_defaults = defaults.generation.vllm
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=vllm_defaults.gpu_memory_utilization,
        help="Share of each producer GPU for vLLM's weights and KV cache (-b vllm only).",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=vllm_defaults.enforce_eager,
        help="vLLM without CUDA graphs (-b vllm only).",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=vllm_defaults.enable_chunked_prefill,
        help="vLLM chunked prefill (-b vllm only).",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=vllm_defaults.max_model_len,
        help="vLLM context length; default: -mpt + -mnt, capped by the model's (-b vllm only).",
    )
    p.add_argument(
        "-a",
        "--algo",
        default="GRPO",
        type=str.upper,
        choices=["GRPO", "DAPO", "RLOO", "REINFORCE_PPB", "DR_GRPO", "GSPO"],
    )
    p.add_argument("-lr", "--learning-rate", type=float, default=defaults.train.learning_rate)
    p.add_argument("-kl", "--kl-coeff", type=float, default=defaults.algorithm.kl_coeff)
    p.add_argument(
        "--old-logprobs",
        choices=["recompute", "behaviour"],
        default=defaults.algorithm.old_logprobs,
        help="pi_old of the ratio: the round's starting policy (recompute) or the producer's log-probs (behaviour).",
    )
    p.add_argument(
        "--ppo-epochs", type=int, default=defaults.train.ppo_epochs, help="Passes over each round's samples."
    )
    p.add_argument(
        "--grad-checkpoint", action="store_true", help="Recompute decoder-layer activations in backward (less memory)."
    )
    p.add_argument(
        "--attn-implementation",
        choices=["sdpa", "eager", "flash_attention_2"],
        default=defaults.train.attn_implementation,
        help="Attention kernel of the trained and reference models (flash_attention_2: GPU with flash-attn).",
    )
    p.add_argument(
        "--full-logits",
        action="store_true",
        help="Compute log-probs from full [tokens, vocabulary] logits instead of from hidden states in chunks.",
    )
    p.add_argument(
        "--sequence-layout",
        choices=["auto", "padded", "packed", "shared_prompt"],
        default=defaults.train.sequence_layout,
        help="Training forward layout: padded rows, packed real tokens, or each group's prompt once (shared_prompt); "
        "auto: shared_prompt (packed with flash_attention_2, padded with -pp > 1).",
    )
    p.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=defaults.train.max_tokens_per_microbatch,
        help="Token budget of one forward/backward (replaces -tmbs when set; verl's dynamic batch size).",
    )
    p.add_argument("-rt", "--reward-type", default="boxed", choices=["boxed", "think_answer_tags", "code"])
    p.add_argument(
        "--reward-fn", default=None, help="User reward plug-in: path/to/file.py:function or module:function."
    )
    p.add_argument("-cv", "--code-verifier-url", default=None, help="HTTP code verifier (see README).")
    p.add_argument("-ei", "--eval-interval", type=int, default=defaults.run.eval_interval)
    p.add_argument("-nb", "--n-behind", type=int, default=defaults.schedule.n_behind)
    p.add_argument("-si", "--save-interval", type=int, default=0, help="Checkpoint every N optimizer steps (0: never).")
    p.add_argument("--save-limit", type=int, default=defaults.run.save_limit, help="Keep the newest N checkpoints.")
    p.add_argument(
        "--no-final-export",
        dest="final_export",
        action="store_false",
        help="Do not write the trained policy as a Hugging Face model into <run dir>/final at the end.",
    )
    p.add_argument("-sd", "--save-dir", default=defaults.run.save_dir, help="Parent directory of run directories.")
    p.add_argument("-esd", "--eval-save-dir", default=None, help="Eval generations; default: <run dir>/eval.")
    p.add_argument("--overwrite-eval-dir", action="store_true", help="Allow an -esd directory that holds files.")
    p.add_argument("-rsd", "--rollout-save-dir", default=None, help="Rollout samples; default: <run dir>/rollouts.")
    p.add_argument(
        "--log-rollout-interval",
        type=int,
        default=defaults.run.log_rollout_interval,
        help="Write rollout samples every N optimizer steps (0: never).",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=defaults.train.warmup_steps, help="Linear learning-rate warm-up."
    )
    p.add_argument(
        "--lr-schedule",
        default=defaults.train.lr_schedule,
        choices=list(LR_SCHEDULE_NAMES),
        help="After warm-up: constant, or cosine decay to --min-lr-ratio x lr at the run's last step.",
    )
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=defaults.train.min_lr_ratio,
        help="Where the cosine schedule ends, as a fraction of -lr.",
    )
    p.add_argument(
        "--eval-temperature",
        type=float,
        default=defaults.generation.eval_temperature,
        help="Evaluation sampling temperature; 0: greedy.",
    )
    p.add_argument(
        "--eval-samples",
        type=int,
        default=defaults.generation.eval_samples,
        help="Responses per eval prompt (needs --eval-temperature > 0 when > 1): logs mean@k and pass@k.",
    )
    p.add_argument(
        "--enable_profiling",
        action="store_true",
        help="Write per-actor phase timings to <run dir>/profile.jsonl (render: python -m colossal_rl.profiling).",
    )
    p.add_argument("--max-steps", type=int, default=None, help="Stop after this many optimizer steps.")
    p.add_argument("--seed", type=int, default=defaults.run.seed)
    p.add_argument("--timeout", type=float, default=defaults.run.timeout_s, help="Seconds any single wait may take.")
    p.add_argument(
        "--producer-threads", type=int, default=None, help="torch threads per producer (default: cores split evenly)."
    )
    p.add_argument(
        "--trainer-threads", type=int, default=None, help="torch threads per trainer (default: cores split evenly)."
    )
    p.add_argument(
        "--weight-sync-backend",
        choices=["torch", "ray_nccl"],
        default=defaults.run.weight_sync_backend,
        help="Weight-sync group: torch (gloo on CPU, ProcessGroupNCCL on GPU) or ray_nccl (Ray's cupy NCCL; GPUs).",
    )
    p.add_argument("--max-infra-error-fraction", type=float, default=defaults.reward.max_infra_error_fraction)
    p.add_argument("--no-wandb", action="store_true", help="Write metrics.jsonl only.")
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML file with any part of the config tree (see --print-config); flags given here override it.",
    )
    p.add_argument("--print-config", action="store_true", help="Print the resolved config as YAML and exit.")
    _help_from_field_docs(p)
    return p


def _help_from_field_docs(parser: argparse.ArgumentParser) -> None:
    """A flag without its own help text gets its config field's docstring (``config.py`` is the source)."""
    from colossal_rl.config_files import field_docs

    docs = field_docs()
    for action in parser._actions:
        field = FLAG_FIELDS.get(action.dest)
        if not action.help and field in docs:
            action.help = docs[field].replace("%", "%%")  # argparse formats help with %


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
        dests = {field: dest for dest, field in FLAG_FIELDS.items()}
        defaults = {}
        for field, value in fields.items():
            dest = dests.get(field)
            if dest is None:
                rest[field] = value
            elif dest == "eval_dataset":
                defaults[dest] = json.dumps(value)
            else:
                defaults[dest] = (not value) if dest in NEGATED_FLAGS else value
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
    """-b vllm needs vLLM installed (checked without importing it); -ptp > 1 needs -b vllm."""
    if args.backend == "vllm":
        from colossal_rl.rollout.backend import VLLM_MISSING, vllm_installed

        if not vllm_installed():
            raise UsageError(VLLM_MISSING)
        from colossal_rl.rollout.vllm_weights import installed_vllm_version, untested_version_warning

        version = installed_vllm_version()
        if version is not None and (warning := untested_version_warning(version)) is not None:
            logger.warning("%s", warning)
    elif args.producer_tensor_parallel_size > 1:
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
    """Build and validate the run config; errors name the flag."""
    from colossal_rl.config_files import ConfigFileError, apply_fields
    from colossal_rl.presets import algorithm_preset

    _check_flags_against_environment(args)
    try:
        algorithm: AlgorithmConfig = replace(
            algorithm_preset(
                args.algo, kl_coeff=args.kl_coeff, max_new_tokens=args.max_new_tokens, n_behind=args.n_behind
            ),
            old_logprobs=args.old_logprobs,
        )
        config = RLConfig(
            model=ModelConfig(path=args.model, trust_remote_code=args.trust_remote_code),
            data=DataConfig(
                train_path=args.dataset,
                eval_paths=_eval_paths(args),
                system_prompt=args.system_prompt,
                max_prompt_tokens=args.max_prompt_tokens,
                prompt_key=args.prompt_key,
                answer_key=args.answer_key,
                seed=args.seed + 42,
            ),
            generation=GenerationConfig(
                backend=args.backend,
                num_generations=args.num_generations,
                temperature=args.temperature,
                eval_temperature=args.eval_temperature,
                eval_samples=args.eval_samples,
                top_k=args.top_k,
                top_p=args.top_p,
                max_new_tokens=args.max_new_tokens,
                microbatch_size=args.inference_microbatch_size,
                tensor_parallel_size=args.producer_tensor_parallel_size,
                stop_strings=("</answer>",) if args.reward_type == "think_answer_tags" else (),
                vllm=VllmEngineConfig(
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    enforce_eager=args.enforce_eager,
                    enable_chunked_prefill=args.enable_chunked_prefill,
                    max_model_len=args.max_model_len,
                ),
            ),
            algorithm=algorithm,
            train=TrainConfig(
                learning_rate=args.learning_rate,
                batch_size=args.train_batch_size,
                minibatch_size=args.train_minibatch_size,
                microbatch_size=args.train_microbatch_size,
                warmup_steps=args.warmup_steps,
                lr_schedule=args.lr_schedule,
                min_lr_ratio=args.min_lr_ratio,
                ppo_epochs=args.ppo_epochs,
                gradient_checkpointing=args.grad_checkpoint,
                attn_implementation=args.attn_implementation,
                logits_from_hidden=not args.full_logits,
                sequence_layout=args.sequence_layout,
                max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            ),
            parallel=ParallelConfig(
                num_trainers=args.num_trainers,
                tp_size=args.tensor_parallel_size,
                pp_size=args.pipeline_parallel_size,
                zero_stage=args.zero_stage,
                precision=args.precision,
            ),
            schedule=ScheduleConfig(
                num_producers=args.num_inferencer,
                inference_batch_size=args.inference_batch_size,
                num_episodes=args.num_episodes,
                n_behind=args.n_behind,
                max_steps=args.max_steps,
            ),
            reward=RewardConfig(
                reward_type=args.reward_type,
                code_verifier_url=args.code_verifier_url,
                reward_fn=args.reward_fn,
                max_infra_error_fraction=args.max_infra_error_fraction,
            ),
            run=RunConfig(
                project=args.project,
                save_dir=args.save_dir,
                eval_interval=args.eval_interval,
                eval_save_dir=args.eval_save_dir,
                overwrite_eval_dir=args.overwrite_eval_dir,
                rollout_save_dir=args.rollout_save_dir,
                log_rollout_interval=args.log_rollout_interval,
                enable_profiling=args.enable_profiling,
                save_interval=args.save_interval,
                save_limit=args.save_limit,
                final_export=args.final_export,
                checkpoint_path=args.checkpoint_path,
                seed=args.seed,
                timeout_s=args.timeout,
                producer_threads=args.producer_threads,
                trainer_threads=args.trainer_threads,
                weight_sync_backend=args.weight_sync_backend,
                ray_dir=args.ray_dir,
                master_address=args.master_address,
                master_port=args.master_port,
            ),
        )
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


def check_inputs(config: RLConfig) -> None:
    """Fail before starting Ray: datasets parse (with what the reward needs), the model is a local directory or
    a hub name that is cached or reachable, and a --reward-fn plug-in loads and scores one row."""
    from colossal_rl.data_sources import RowKeys, load_prompt_rows

    keys = RowKeys.for_config(config)
    train_rows = load_prompt_rows(config.data.train_path, keys)
    for _, path in config.data.eval_paths:
        load_prompt_rows(path, keys)
    _check_model(config.model.path)
    if config.reward.reward_fn is not None:
        _check_reward_plugin(config.reward.reward_fn, train_rows[0], config.data.train_path)


def _check_model(model: str) -> None:
    """A local directory with a config.json, or a hub name in the local cache or on a reachable hub."""
    looks_local = model.startswith((".", "/", "~")) or Path(model).exists() or model.count("/") != 1
    if looks_local:
        if not (Path(model).expanduser() / "config.json").is_file():
            raise UsageError(f"-m/--model: no model directory with a config.json at {model!r}")
        return
    from huggingface_hub import try_to_load_from_cache

    from colossal_rl.data_sources import hub_reachable

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return  # cached: loads offline
    if not hub_reachable():
        raise UsageError(
            f"-m/--model: {model!r} is not a local directory, not in the Hugging Face cache, and the hub is not "
            "reachable (download it where there is network, or give a local path)"
        )


def _check_reward_plugin(spec: str, row: dict, source: str) -> None:
    """The plug-in loads, has the right signature, and scores one training row (an empty response) without
    raising: the user's own code, checked here so a mistake costs seconds instead of a run of infra errors."""
    from colossal_rl.reward.plugins import RewardConfigError, load_reward_fn
    from colossal_rl.reward.records import record_from_plugin_value

    try:
        function = load_reward_fn(spec)
    except RewardConfigError as error:
        raise UsageError(f"--reward-fn: {error}") from None
    try:
        record_from_plugin_value(function("", row))
    except Exception as error:  # whatever the user's code raises, named in one line
        raise UsageError(
            f"--reward-fn {spec!r}: scoring an empty response to the first row of {source} raised "
            f"{type(error).__name__}: {error}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    from colossal_rl.checkpoint import CheckpointError
    from colossal_rl.data import DataError
    from colossal_rl.launch import RunFailed, run_training
    from colossal_rl.placement import PlacementError
    from colossal_rl.run_outputs import OutputDirError

    try:
        config = config_from_args(args)
        if args.print_config:
            from colossal_rl.config_files import config_to_yaml

            sys.stdout.write(config_to_yaml(config))
            return 0
        check_inputs(config)
        summary = run_training(config, use_wandb=not args.no_wandb)
    except (UsageError, DataError, RunFailed, CheckpointError, OutputDirError, PlacementError) as error:
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
