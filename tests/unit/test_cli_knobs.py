"""Every flag of rl_example.py reaches the config field it names: none is parsed and then dropped.

``FLAG_PROBES`` gives, for every flag, arguments setting it to a non-default value and the config field that
must change. A new flag without a probe fails ``test_every_flag_has_a_probe``, so its author shows it acts.
"""

import argparse
import sys
from functools import reduce
from pathlib import Path

import pytest

import colossal_rl.command_line as command_line
import colossal_rl.rollout.backend as backend_module
from colossal_rl.driver.placement import ANY_FREE_PORT, CLUSTER_MASTER_PORT, trainer_master_port

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root, not part of the package

from rl_example import FLAG_FIELDS, NOT_CONFIG_FLAGS, UsageError, build_parser, config_from_args  # noqa: E402

# flag destination -> (arguments setting a non-default value, the config field it must change)
FLAG_PROBES = {
    "model": (["-m", "Qwen/Qwen2.5-0.5B"], "model.path"),
    "trust_remote_code": (["--trust-remote-code"], "model.trust_remote_code"),
    "routing_replay": (["--routing-replay"], "model.routing_replay"),
    "router_aux_loss_coef": (["--router-aux-loss-coef", "0.001"], "train.router_aux_loss_coef"),
    "checkpoint_path": (["-cp", "runs/x"], "run.checkpoint_path"),
    "dataset": (["-d", "other.jsonl"], "data.train_path"),
    "eval_dataset": (["-ed", '{"gsm": "gsm.jsonl"}'], "data.eval_paths"),
    "project": (["-p", "other"], "run.project"),
    "num_episodes": (["-e", "2"], "schedule.num_episodes"),
    "num_trainers": (["-t", "2", "-ibs", "32"], "parallel.num_trainers"),
    "num_inferencer": (["-i", "2"], "schedule.num_producers"),
    "num_generations": (["-g", "4"], "generation.num_generations"),
    "inference_batch_size": (["-ibs", "32"], "schedule.inference_batch_size"),
    "inference_microbatch_size": (["-imbs", "8"], "generation.microbatch_size"),
    "train_batch_size": (["-tbs", "8", "-tMbs", "8"], "train.batch_size"),
    "train_minibatch_size": (["-tMbs", "8"], "train.minibatch_size"),
    "train_microbatch_size": (["-tmbs", "16"], "train.microbatch_size"),
    "tensor_parallel_size": (["-tp", "2", "-t", "2"], "parallel.tp_size"),
    "pipeline_parallel_size": (["-pp", "2", "-t", "2"], "parallel.pp_size"),
    "zero_stage": (["-zero", "1"], "parallel.zero_stage"),
    "precision": (["--precision", "bf16"], "parallel.precision"),
    "trainer_backend": (["--trainer-backend", "fsdp2"], "parallel.trainer_backend"),
    "ray_dir": (["--ray-dir", "/tmp/ray_x"], "run.ray_dir"),
    "master_address": (["--master-address", "10.0.0.1"], "run.master_address"),
    "master_port": (["--master-port", "31000"], "run.master_port"),
    "backend": (["-b", "vllm"], "generation.backend"),
    "temperature": (["-temp", "0.7"], "generation.temperature"),
    "top_k": (["-topk", "5"], "generation.top_k"),
    "top_p": (["-topp", "0.9"], "generation.top_p"),
    "system_prompt": (["-s", "Be brief."], "data.system_prompt"),
    "max_new_tokens": (["-mnt", "32"], "generation.max_new_tokens"),
    "max_prompt_tokens": (["-mpt", "256"], "data.max_prompt_tokens"),
    "prompt_key": (["--prompt-key", "problem"], "data.prompt_key"),
    "answer_key": (["--answer-key", "solution"], "data.answer_key"),
    "producer_tensor_parallel_size": (["-b", "vllm", "-ptp", "2"], "generation.tensor_parallel_size"),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], "generation.vllm.gpu_memory_utilization"),
    "enforce_eager": (["--no-enforce-eager"], "generation.vllm.enforce_eager"),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], "generation.vllm.enable_chunked_prefill"),
    "max_model_len": (["--max-model-len", "4096"], "generation.vllm.max_model_len"),
    "block_size": (["--block-size", "32"], "generation.vllm.block_size"),
    "vllm_weight_receive": (["--vllm-weight-receive", "producer"], "generation.vllm.weight_receive"),
    "algo": (["-a", "RLOO"], "algorithm.name"),
    "learning_rate": (["-lr", "1e-5"], "train.learning_rate"),
    "kl_coeff": (["-kl", "0.01"], "algorithm.kl_coeff"),
    "old_logprobs": (["--old-logprobs", "behaviour"], "algorithm.old_logprobs"),
    "dpo_beta": (["-a", "ONLINE_DPO", "--dpo-beta", "0.3"], "algorithm.dpo_beta"),
    "ppo_epochs": (["--ppo-epochs", "2"], "train.ppo_epochs"),
    "grad_checkpoint": (["--grad-checkpoint"], "train.gradient_checkpointing"),
    "attn_implementation": (["--attn-implementation", "eager"], "train.attn_implementation"),
    "full_logits": (["--full-logits"], "train.logits_from_hidden"),
    "sequence_layout": (["--sequence-layout", "packed"], "train.sequence_layout"),
    "max_tokens_per_microbatch": (["--max-tokens-per-microbatch", "512"], "train.max_tokens_per_microbatch"),
    "lora_rank": (["--lora-rank", "4"], "train.lora_rank"),
    "lora_alpha": (["--lora-alpha", "8"], "train.lora_alpha"),
    "lora_target_modules": (["--lora-target-modules", "q_proj,v_proj"], "train.lora_target_modules"),
    "freeze_vision_tower": (["--freeze-vision-tower"], "train.freeze_vision_tower"),
    "image_key": (["--image-key", "image"], "data.image_key"),
    "min_pixels": (["--min-pixels", "3136"], "data.min_pixels"),
    "max_pixels": (["--max-pixels", "12544"], "data.max_pixels"),
    "limit_images": (["--limit-images", "1"], "data.limit_images"),
    "reward_type": (["-rt", "think_answer_tags"], "reward.reward_type"),
    "reward_fn": (["--reward-fn", "my_reward.py:score"], "reward.reward_fn"),
    "reward_mix": (["--reward-mix", "boxed=1,my_reward.py:style=0.3"], "reward.mix"),
    "reward_model": (["-rt", "model", "--reward-model", "rm"], "reward.reward_model"),
    "reward_actors": (["--reward-actors", "3"], "reward.reward_actors"),
    "reward_normalisation": (["--reward-normalisation", "raw"], "reward.reward_normalisation"),
    "reward_batch_size": (["--reward-batch-size", "8"], "reward.reward_batch_size"),
    "judge_template": (
        ["-rt", "judge", "--judge-template", "judge.txt", "--judge-model", "judge-llm"],
        "reward.judge_template",
    ),
    "judge_rule": (["--judge-rule", "choice:yes=1,no=0"], "reward.judge_rule"),
    "judge_url": (
        [
            "-rt",
            "judge",
            "--judge-template",
            "judge.txt",
            "--judge-model",
            "judge-llm",
            "--judge-url",
            "http://127.0.0.1:8000/v1",
        ],
        "reward.judge_url",
    ),
    "judge_model": (
        ["-rt", "judge", "--judge-template", "judge.txt", "--judge-model", "judge-llm"],
        "reward.judge_model",
    ),
    "judge_token_file": (
        [
            "-rt",
            "judge",
            "--judge-template",
            "judge.txt",
            "--judge-model",
            "judge-llm",
            "--judge-token-file",
            "token.txt",
        ],
        "reward.judge_token_file",
    ),
    "judge_concurrency": (["--judge-concurrency", "2"], "reward.judge_concurrency"),
    "code_verifier_url": (["-cv", "http://localhost:8000"], "reward.code_verifier_url"),
    "env": (["--env", "calculator"], "environment.name"),
    "max_turns": (["--max-turns", "2"], "environment.max_turns"),
    "max_total_tokens": (["--max-total-tokens", "64"], "environment.max_total_tokens"),
    "eval_interval": (["-ei", "5"], "run.eval_interval"),
    "n_behind": (["-nb", "0"], "schedule.n_behind"),
    "save_interval": (["-si", "10"], "run.save_interval"),
    "final_export": (["--no-final-export"], "run.final_export"),
    "save_limit": (["--save-limit", "1"], "run.save_limit"),
    "save_dir": (["-sd", "elsewhere"], "run.save_dir"),
    "eval_save_dir": (["-esd", "evals"], "run.eval_save_dir"),
    "overwrite_eval_dir": (["--overwrite-eval-dir"], "run.overwrite_eval_dir"),
    "rollout_save_dir": (["-rsd", "rollouts"], "run.rollout_save_dir"),
    "log_rollout_interval": (["--log-rollout-interval", "5"], "run.log_rollout_interval"),
    "warmup_steps": (["--warmup-steps", "3"], "train.warmup_steps"),
    "lr_schedule": (["--lr-schedule", "cosine"], "train.lr_schedule"),
    "max_infra_error_fraction": (["--max-infra-error-fraction", "0.2"], "reward.max_infra_error_fraction"),
    "reward_timeout": (["--reward-timeout", "2.5"], "reward.reward_timeout_s"),
    "min_lr_ratio": (["--min-lr-ratio", "0.1"], "train.min_lr_ratio"),
    "eval_temperature": (["--eval-temperature", "0.7"], "generation.eval_temperature"),
    "eval_samples": (["--eval-temperature", "0.7", "--eval-samples", "4"], "generation.eval_samples"),
    "enable_profiling": (["--enable-profiling"], "run.enable_profiling"),
    "max_steps": (["--max-steps", "7"], "schedule.max_steps"),
    "schedule": (["--schedule", "stream"], "schedule.mode"),
    "max_staleness": (["--max-staleness", "2"], "schedule.max_staleness"),
    "sync_every_steps": (["--sync-every-steps", "2"], "schedule.sync_every_steps"),
    "continuous_batching": (["--continuous-batching", "--schedule", "stream"], "generation.continuous_batching"),
    "partial_rollouts": (
        ["--partial-rollouts", "--continuous-batching", "--schedule", "stream"],
        "generation.partial_rollouts",
    ),
    "seed": (["--seed", "3"], "run.seed"),
    "timeout": (["--timeout", "30"], "run.timeout_s"),
    "max_actor_restarts": (["--max-actor-restarts", "0"], "run.max_actor_restarts"),
    "resume_fallback": (["--resume-fallback"], "run.resume_fallback"),
    "producer_threads": (["--producer-threads", "1"], "run.producer_threads"),
    "trainer_threads": (["--trainer-threads", "1"], "run.trainer_threads"),
    "weight_sync_backend": (["--weight-sync-backend", "ray_nccl"], "run.weight_sync_backend"),
    "weight_sync_mode": (["--weight-sync-mode", "shm"], "run.weight_sync_mode"),
}
# Fields with no flag of their own, set through --config (or derived: data.seed from --seed, stop strings from the
# reward type, the algorithm's fields from its preset -a).
CONFIG_FILE_ONLY = {
    "data.seed",
    "generation.stop_strings",
    "train.max_norm",
    "train.weight_decay",
}
CONFIG_FILE_ONLY_SECTIONS = ("algorithm.",)


def config_for(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def field(config, path: str):
    return reduce(getattr, path.split("."), config)


def test_every_flag_has_a_probe():
    destinations = {action.dest for action in build_parser()._actions}
    assert destinations - NOT_CONFIG_FLAGS == set(FLAG_PROBES)


def test_the_flag_table_is_the_one_the_probes_check():
    assert FLAG_FIELDS == {dest: path for dest, (_, path) in FLAG_PROBES.items()}


def test_every_settable_field_has_exactly_one_flag_or_is_a_config_file_field_and_every_flag_has_help():
    from colossal_rl.config_fields import field_docs

    fields = set(field_docs())
    flagged = list(FLAG_FIELDS.values())
    assert len(flagged) == len(set(flagged)), "a field with two flags"
    assert set(flagged) <= fields
    without_flag = {f for f in fields - set(flagged) if not f.startswith(CONFIG_FILE_ONLY_SECTIONS)}
    assert without_flag == CONFIG_FILE_ONLY
    for action in build_parser()._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"


@pytest.mark.parametrize("dest", sorted(FLAG_PROBES))
def test_flag_changes_the_field_it_names(dest, monkeypatch):
    # -b vllm and --weight-sync-backend ray_nccl are also checked against the installed packages (their own tests)
    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    monkeypatch.setattr(command_line, "_check_weight_sync_backend", lambda args: None)
    argv, path = FLAG_PROBES[dest]
    assert field(config_for(*argv), path) != field(config_for(), path)


def test_master_port_flag_is_validated_and_reaches_the_run_config():
    assert config_for().run.master_port is None
    assert config_for("--master-port", "31000").run.master_port == 31000
    with pytest.raises(UsageError, match=r"^--master-port: must be in 1\.\.65535"):
        config_for("--master-port", "70000")


# ColossalChat's underscore spellings: the same field as the dashed flag, accepted but not listed in help
UNDERSCORE_ALIASES = {
    "--ray_dir": (["/tmp/ray_x"], "--ray-dir"),
    "--master_address": (["10.0.0.1"], "--master-address"),
    "--master_port": (["31000"], "--master-port"),
    "--enable_profiling": ([], "--enable-profiling"),
}


@pytest.mark.parametrize("alias", sorted(UNDERSCORE_ALIASES))
def test_an_underscore_alias_sets_the_field_its_dashed_flag_sets(alias):
    values, dashed = UNDERSCORE_ALIASES[alias]
    assert build_parser().parse_args([alias, *values]) == build_parser().parse_args([dashed, *values])
    assert config_for(alias, *values) == config_for(dashed, *values) != config_for()


def test_help_lists_each_flag_dashed_and_no_underscore_spelling():
    text = build_parser().format_help()
    for alias, (_, dashed) in UNDERSCORE_ALIASES.items():
        assert dashed in text and alias not in text
    long_names = [name for action in build_parser()._actions if action.help != argparse.SUPPRESS
                  for name in action.option_strings if name.startswith("--")]  # fmt: skip
    assert [name for name in long_names if "_" in name] == []


def test_trainers_meet_on_the_given_port_locally_and_on_a_cluster():
    assert trainer_master_port(31000, joins_cluster=False) == 31000
    assert trainer_master_port(31000, joins_cluster=True) == 31000


def test_trainers_meet_on_a_port_trainer_0_binds_locally_and_on_29506_on_a_cluster_by_default():
    assert trainer_master_port(None, joins_cluster=False) == ANY_FREE_PORT == 0
    assert trainer_master_port(None, joins_cluster=True) == CLUSTER_MASTER_PORT == 29506


def test_trainer_0_holds_the_rendezvous_port_from_the_moment_it_is_chosen():
    """Port 0: trainer 0's store binds a free port at once, so no other process can take it before the others
    connect (a port the driver picked free and trainer 0 bound seconds later once went to another listener)."""
    import datetime
    import socket

    import torch.distributed as dist

    from colossal_rl.training.booster_plugins import open_rendezvous_store

    store = open_rendezvous_store(ANY_FREE_PORT, 2, timeout_s=5)
    assert store.port > 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("", store.port))
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("rank 1", "here")
    assert store.get("rank 1") == b"here"
