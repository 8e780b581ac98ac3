"""Break the code on purpose, on a copy, and check that the tests meant to notice each breakage fail.

Every entry of ``MUTATIONS`` names one deliberate bug: a file, an exact piece of its text, what to put
instead, and the pytest node ids that must catch it. For each selected mutation the repository is copied
to a temporary directory (without ``.git``, ``.venv`` and caches), the text is replaced — it must occur
exactly once, so an entry whose code has moved is reported instead of silently testing nothing — and
the listed tests run in the copy with this interpreter. Verdicts:

- ``caught``: every listed test failed;
- ``MISSED``: a listed test passed (or was skipped) with the bug in place;
- ``ERROR``: the text was not found once, a listed test was not collected, or pytest could not run.

A baseline run first checks that every listed test passes on an unmutated copy (a test that always
fails would "catch" everything). The exit status is non-zero unless the baseline passed and every
mutation was caught.

    python scripts/mutation_check.py                 # baseline + every mutation
    python scripts/mutation_check.py --list          # what would run
    python scripts/mutation_check.py --only NAME     # one (repeatable); --no-baseline to skip the baseline
    python scripts/mutation_check.py --unit-only     # only mutations caught by tests/unit (no dist/e2e runs)

Adding one: append a ``Mutation`` below; ``old`` must be copied verbatim from the file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", "runs", "wandb"
)
TIMEOUT_S = 1800  # one pytest run (the distributed layouts test alone takes minutes on two shared cores)


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str
    """The bug it stands for, in one line."""
    path: str
    """File to change, relative to the repository root."""
    old: str
    """Exact text, occurring exactly once in ``path``."""
    new: str
    tests: tuple[str, ...]
    """Pytest node ids that must all fail with the mutation in place."""


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="sandbox_shows_host_files",
        why="the code sandbox binds the host's /etc and the checkout read-only",
        path="reward/sandbox.py",
        old='        args += ["--ro-bind", str(files.directory), "/sandbox", "--chdir", "/tmp", "--remount-ro", "/"]\n',
        new='        args += ["--ro-bind", "/etc", "/etc", "--ro-bind", str(_HERE.parent), str(_HERE.parent)]\n'
        '        args += ["--ro-bind", str(files.directory), "/sandbox", "--chdir", "/tmp", "--remount-ro", "/"]\n',
        tests=(
            "tests/unit/test_reward_code_hostile.py::test_hostile_program[read_host_files]",
            "tests/unit/test_reward_code_hostile.py::test_host_files_are_invisible_unless_mounted[real]",
        ),
    ),
    Mutation(
        name="objective_ignores_policy_loss",
        why="every preset gets the token-level clipped loss (GSPO silently computed as GRPO's)",
        path="colossal_rl/training/objective.py",
        old="policy_loss = POLICY_LOSSES.get(algo.policy_loss)",
        new='policy_loss = POLICY_LOSSES.get("clipped")',
        tests=("tests/unit/test_preset_dispatch.py::test_preset_loss_is_its_configured_formula[GSPO]",),
    ),
    Mutation(
        name="objective_ignores_loss_aggregation",
        why="every preset's loss is aggregated per sample (DAPO's token mean, Dr. GRPO's constant length lost)",
        path="colossal_rl/training/objective.py",
        old="aggregate = LOSS_AGGREGATIONS.get(algo.loss_aggregation)",
        new='aggregate = LOSS_AGGREGATIONS.get("sample_level")',
        tests=(
            "tests/unit/test_preset_dispatch.py::test_preset_loss_is_its_configured_formula[DAPO]",
            "tests/unit/test_preset_dispatch.py::test_preset_loss_is_its_configured_formula[DR_GRPO]",
        ),
    ),
    Mutation(
        name="postprocess_ignores_advantage_estimator",
        why="producers compute GRPO advantages whatever the preset configures",
        path="colossal_rl/rollout/postprocess.py",
        old="estimate = group_part(algo.advantage_estimator)",
        new='estimate = group_part("grpo")',
        tests=(
            "tests/unit/test_preset_dispatch.py::test_preset_advantages_are_its_configured_estimator[RLOO]",
            "tests/unit/test_preset_dispatch.py::test_preset_advantages_are_its_configured_estimator[DR_GRPO]",
            "tests/unit/test_preset_dispatch.py::test_preset_advantages_are_its_configured_estimator[REINFORCE_PPB]",
        ),
    ),
    Mutation(
        name="lr_scheduler_not_restored",
        why="resuming restarts the learning-rate warm-up",
        path="colossal_rl/run_checkpoints/trainer_state.py",
        old="    booster.load_lr_scheduler(lr_scheduler, str(directory / SCHEDULER_FILE))\n",
        new="",
        tests=("tests/unit/test_trainer_resume.py::test_resumed_trainer_continues_like_the_uninterrupted_one",),
    ),
    Mutation(
        name="rng_not_restored",
        why="resuming trains with a different random stream (dropout) than the uninterrupted run",
        path="colossal_rl/run_checkpoints/trainer_state.py",
        old='    torch.set_rng_state(rng["torch"])\n',
        new="",
        tests=("tests/unit/test_trainer_resume.py::test_resumed_trainer_continues_like_the_uninterrupted_one",),
    ),
    Mutation(
        name="export_moves_trainer_rng",
        why="the HF export at a checkpoint draws from the trainer's RNG, so the resumed run's dropout differs",
        path="colossal_rl/run_checkpoints/trainer_state.py",
        old="    with torch.random.fork_rng(devices=[]):\n",
        new="    if True:\n",
        tests=("tests/unit/test_trainer_resume.py::test_resumed_trainer_continues_like_the_uninterrupted_one",),
    ),
    Mutation(
        name="sync_checksum_unchecked",
        why="a receiver accepts a sync whose header carries another weight layout's plan checksum",
        path="colossal_rl/comm/weight_sync/bucketed.py",
        old="        if checksum != self.checksum:\n",
        new="        if False:\n",
        tests=(
            "tests/unit/test_weight_sync.py::test_receiver_refuses_a_sync_with_another_plan_checksum_and_stays_in_step",
        ),
    ),
    Mutation(
        name="producer_loads_stale_weights",
        why="a producer loads a weights version that is not newer than the one it holds",
        path="colossal_rl/rollout/producer.py",
        old="        if policy_version <= self.policy_version:\n",
        new="        if False:\n",
        tests=("tests/unit/test_producer_weights.py::test_load_weights_refuses_a_version_that_is_not_newer",),
    ),
    Mutation(
        name="lr_divided_by_world_size",
        why="trainers in a 2-process layout update with half the learning rate (seen only in the weights)",
        path="colossal_rl/training/trainer.py",
        old="lr=train.learning_rate, weight_decay=train.weight_decay",
        new="lr=train.learning_rate / self.world_size, weight_decay=train.weight_decay",
        tests=("tests/dist/test_plugin_layouts.py::test_layout_weights_match_single_process[hybrid_zero1_dp2]",),
    ),
    Mutation(
        name="tp_logits_shifted",
        why="tensor-parallel logits gathered off by one vocabulary column (wrong TP x PP weights, synced faithfully)",
        path="colossal_rl/training/booster_plugins.py",
        old="    return full[..., :vocab_size]\n",
        new="    return full.roll(1, -1)[..., :vocab_size]\n",
        tests=("tests/dist/test_stage_sync_tp_pp.py::test_synced_weights_match_a_single_process_reference",),
    ),
    Mutation(
        name="old_logprobs_are_new_detached",
        why="pi_old is the step's own forward again: the PPO ratio is always 1 and no clip ever acts",
        path="colossal_rl/training/step_loss.py",
        old="old_logprobs = new_logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs",
        new="old_logprobs = new_logprobs.detach()",
        tests=(
            "tests/unit/test_trainer_old_logprobs.py::test_a_token_outside_the_clip_range_gives_no_gradient",
            "tests/unit/test_trainer_old_logprobs.py::test_dual_clip_bounds_a_negative_advantage_token",
            "tests/unit/test_trainer_old_logprobs.py::test_gspo_clips_the_sequence_ratio",
            "tests/unit/test_trainer_old_logprobs.py::test_skip_threshold_drops_a_runaway_sample",
            "tests/unit/test_trainer_old_logprobs.py::test_later_steps_of_a_round_see_the_round_start_policy",
        ),
    ),
    Mutation(
        name="step_inputs_left_on_host",
        why="a step's samples are not moved to the trainer's device (the first GPU train_step fails)",
        path="colossal_rl/training/trainer.py",
        old="                chunk = chunk.to(self.device, non_blocking=True)\n",
        new="",
        tests=("tests/unit/test_trainer_device.py::test_round_on_a_second_device_equals_the_host_run",),
    ),
    Mutation(
        name="reference_model_left_on_host",
        why="the KL reference model is loaded on the host while the policy trains on the device",
        path="colossal_rl/training/trainer.py",
        old="""        reference = load_policy(
            self.config.model.path,
            dtype=dtype,
            device=self.device,""",
        new="""        reference = load_policy(
            self.config.model.path,
            dtype=dtype,
            device="cpu",""",
        tests=("tests/unit/test_trainer_device.py::test_round_on_a_second_device_equals_the_host_run",),
    ),
    Mutation(
        name="collective_scalars_on_host",
        why="the data-parallel sums are all-reduced from host tensors (NCCL takes device tensors only)",
        path="colossal_rl/training/trainer.py",
        old="tensor = torch.tensor(values, dtype=torch.float64, device=self.device)",
        new="tensor = torch.tensor(values, dtype=torch.float64)",
        tests=("tests/unit/test_trainer_device.py::test_round_on_a_second_device_equals_the_host_run",),
    ),
    Mutation(
        name="text_after_an_image_counts_its_tokens",
        why="multimodal positions resume after an image at its token count, not one past its largest position",
        path="colossal_rl/vision/rope.py",
        old="        next_position = int(grid.max()) + next_position + 1\n",
        new="        next_position += t * merged_h * merged_w\n",
        tests=("tests/unit/test_vision.py::test_positions_equal_the_models_get_rope_index",),
    ),
    Mutation(
        name="generated_image_token_gets_image_features",
        why="the trainer scatters image features into every image token, a generated one too",
        path="colossal_rl/training/micro_batch_forward.py",
        old="    slots = (input_ids == image_token_id) & prompt_token_mask.to(input_ids.device)\n",
        new="    slots = input_ids == image_token_id\n",
        tests=("tests/unit/test_vision.py::test_a_response_with_an_image_token_is_embedded_as_a_token",),
    ),
    Mutation(
        name="frozen_vision_tower_still_synced",
        why="--freeze-vision-tower freezes the tower but the weight sync still carries it",
        path="colossal_rl/training/trainer.py",
        old="            state = without_vision_tower(state)  # it never changes: producers keep the tower they loaded\n",
        new="            pass\n",
        tests=("tests/unit/test_vision.py::test_a_frozen_tower_gets_no_gradient_and_is_not_synced[True]",),
    ),
    Mutation(
        name="pixels_left_on_the_host",
        why="the trainer's pixel values stay on the host while the model is on the accelerator (fails on a GPU)",
        path="colossal_rl/vision/inputs.py",
        old='        "pixel_values": torch.cat([v.pixel_values for v in present]).to(device, dtype),\n',
        new='        "pixel_values": torch.cat([v.pixel_values for v in present]).to(dtype=dtype),\n',
        tests=("tests/unit/test_vision.py::test_a_vision_step_on_a_second_device_equals_the_host_run[packed]",),
    ),
    Mutation(
        name="crash_after_right_output_passes",
        why="a program that prints the right answer and then exits non-zero scores passed (reward hacking)",
        path="reward/code_tests.py",
        old="    if result.exit_code != 0:\n",
        new="    if result.exit_code != 0 and not result.stdout.strip():\n",
        tests=(
            "tests/unit/test_reward_code.py::test_stdin_verdict[right_output_then_crash]",
            "tests/unit/test_reward_code.py::test_stdin_verdict[right_output_then_killed]",
            "tests/unit/test_reward_code.py::test_call_verdict[right_value_then_crash]",
            "tests/unit/test_reward_code.py::test_call_verdict[forged_marker_then_killed]",
            "tests/unit/test_reward_code.py::test_a_program_that_prints_the_right_answers_then_crashes_scores_zero",
            "tests/unit/test_reward_code.py::test_right_output_then_a_crash_scores_zero",
        ),
    ),
    Mutation(
        name="math_normalisation_strips_zeros",
        why='answer normalisation strips trailing zeros with the full stop: "10", "100" and "1" become equal',
        path="reward/extract.py",
        old='    return text.rstrip(".")\n',
        new='    return text.rstrip(".0")\n',
        tests=(
            "tests/unit/test_reward_math.py::test_normalize_answer_hand_computed[10-10]",
            "tests/unit/test_reward_math.py::test_normalisation_keeps_different_numbers_apart",
            "tests/unit/test_reward_math.py::test_boxed_answers_that_differ_are_several_candidates",
            "tests/unit/test_reward_math.py::test_boxed_verdicts[10_is_not_1]",
            "tests/unit/test_reward_math.py::test_boxed_verdicts[100_is_not_10]",
            "tests/unit/test_reward_math.py::test_boxed_verdicts[10_then_1]",
            "tests/unit/test_reward_math.py::test_boxed_answers",
        ),
    ),
    Mutation(
        name="pi_old_recomputed_every_epoch",
        why="pi_old is recomputed at the current weights for every --ppo-epochs pass, not once at the round's start",
        path="colossal_rl/training/trainer.py",
        old="""        with self.phases.record("old_logprobs"):
            steps = self._with_old_logprobs(steps)
        metrics = []
        for epoch in range(self.config.train.ppo_epochs):
""",
        new="""        metrics = []
        for epoch in range(self.config.train.ppo_epochs):
            with self.phases.record("old_logprobs"):
                steps = self._with_old_logprobs(steps)
""",
        tests=("tests/unit/test_trainer_old_logprobs.py::test_every_ppo_epoch_uses_the_round_start_policy_as_pi_old",),
    ),
    Mutation(
        name="batch_stats_count_invalid_samples",
        why="reinforce's batch mean and reinforce_ppb_sample's batch std count masked-out samples (as zeros)",
        path="colossal_rl/algorithms/advantages.py",
        old="        if not self.token_weighted or response_lengths is None:\n            return valid\n",
        new="        if not self.token_weighted or response_lengths is None:\n            return torch.ones_like(valid)\n",
        tests=(
            "tests/unit/test_advantages.py::test_reinforce_ppb_sample_valid_mask_hand_computed",
            "tests/unit/test_advantages.py::test_an_invalid_group_is_as_if_removed[reinforce_ppb_sample]",
            "tests/unit/test_advantages.py::test_reinforce_valid_mask_hand_computed",
            "tests/unit/test_advantages.py::test_an_invalid_group_is_as_if_removed[reinforce]",
        ),
    ),
    Mutation(
        name="dynamic_sampling_counts_invalid_correct",
        why="dynamic sampling's group accuracy counts the correct answers of masked-out samples",
        path="colossal_rl/algorithms/filters.py",
        old="    accuracy = (correct * valid).sum(-1) / count.clamp(min=1)\n",
        new="    accuracy = correct.sum(-1) / count.clamp(min=1)\n",
        tests=("tests/unit/test_filters.py::test_dynamic_sampling_accuracy_over_valid_samples_hand_computed",),
    ),
    Mutation(
        name="tis_weights_clamped_below",
        why="the truncated importance weight's cap also raises weights below 1 / cap (tests had weights >= 1 only)",
        path="colossal_rl/algorithms/off_policy.py",
        old="    return log_ratio.clamp(max=math.log(cap)).exp()\n",
        new="    return log_ratio.clamp(-math.log(cap), math.log(cap)).exp()\n",
        tests=(
            "tests/unit/test_off_policy.py::test_truncated_importance_weights_below_one_are_not_raised",
            "tests/unit/test_objective.py::test_truncated_importance_weights_scale_the_policy_loss",
        ),
    ),
    Mutation(
        name="k3_log_ratio_clamped_above_only",
        why="k3's log-ratio clamp loses its lower side (+-20 documented; nothing tested either side)",
        path="colossal_rl/algorithms/kl.py",
        old="    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)\n",
        new="    log_ratio = (ref_logprobs - logprobs).clamp(max=MAX_LOG_RATIO)\n",
        tests=("tests/unit/test_losses.py::test_k3_clamps_the_log_ratio_on_both_sides",),
    ),
    Mutation(
        name="checkpoint_hash_checked_for_trainer_files_only",
        why="resume compares sha256 only for trainer/ files: a same-size corrupted HF export, state or buffer loads",
        path="colossal_rl/run_checkpoints/on_disk.py",
        old="        if file_digest(file) != sha256:\n",
        new='        if name.startswith("trainer/") and file_digest(file) != sha256:\n',
        tests=(
            "tests/unit/test_checkpoint_verification.py::test_a_flip_is_caught_by_the_hash[hf/model.safetensors]",
            "tests/unit/test_checkpoint_verification.py::test_a_flip_is_caught_by_the_hash[hf/config.json]",
            "tests/unit/test_checkpoint_verification.py::test_a_flip_is_caught_by_the_hash[state.json]",
            "tests/unit/test_checkpoint_verification.py::test_a_flip_is_caught_by_the_hash[chunks.pt]",
        ),
    ),
    Mutation(
        name="checkpoint_digest_of_the_first_chunk_only",
        why="a checkpoint file's sha256 covers only its first 8 MB chunk: damage further into a shard goes unseen",
        path="colossal_rl/run_checkpoints/on_disk.py",
        old="        while chunk := handle.read(_HASH_CHUNK):\n",
        new="        if chunk := handle.read(_HASH_CHUNK):\n",
        tests=("tests/unit/test_checkpoint_verification.py::test_a_flipped_byte_past_the_first_hash_chunk_is_caught",),
    ),
    Mutation(
        name="shm_checksum_unchecked",
        why="a shared-memory receiver reads a slot stamped with another layout's plan checksum as its own layout",
        path="colossal_rl/comm/weight_sync/shared_memory.py",
        old="                if checksum != self.checksum:\n",
        new="                if False:\n",
        tests=("tests/unit/test_weight_sync_modes.py::test_shm_receiver_refuses_a_version_written_for_another_layout",),
    ),
    Mutation(
        name="gpu_runs_default_to_fp32",
        why="--precision auto resolves to fp32 on GPUs too (GPU runs train in fp32 unless told otherwise)",
        path="colossal_rl/config.py",
        old='    return "bf16" if on_gpu else "fp32"\n',
        new='    return "fp32"\n',
        tests=("tests/unit/test_precision_default.py::test_the_default_precision_is_bf16_on_gpus_and_fp32_on_cpu",),
    ),
    Mutation(
        name="vision_packed_under_flash_attention",
        why="auto packs a vision-language model's samples under flash_attention_2 (they attend to each other)",
        path="colossal_rl/config.py",
        old='            return "padded" if vision_language else "packed"\n',
        new='            return "packed"\n',
        tests=(
            "tests/unit/test_vision_gpu_paths.py::test_auto_gives_a_vision_model_the_padded_layout_under_flash_attention",
        ),
    ),
    Mutation(
        name="vision_bf16_on_the_hybrid_plugin",
        why="a vision-language model in bf16 without ZeRO goes to HybridParallelPlugin (no ShardFormer policy)",
        path="colossal_rl/training/booster_plugins.py",
        old="    if vision_language:\n",
        new="    if False:\n",
        tests=("tests/unit/test_vision_gpu_paths.py::test_a_vision_model_in_bf16_without_zero_boosts_and_trains",),
    ),
    Mutation(
        name="producer_generates_on_the_cpu",
        why="the transformers producer leaves its model on the CPU although Ray reserved it a GPU",
        path="colossal_rl/rollout/transformers_backend.py",
        old="        self.model.to(self.device).eval()\n",
        new="        self.model.eval()\n",
        tests=("tests/unit/test_producer_device.py::test_a_producer_with_a_gpu_generates_on_it",),
    ),
    Mutation(
        name="producer_prompts_left_on_the_host",
        why="the producer's prompts stay on the host while its model is on the GPU (fails on a GPU)",
        path="colossal_rl/rollout/transformers_backend.py",
        old="            unique_ids.to(self.device),\n",
        new="            unique_ids,\n",
        tests=("tests/unit/test_producer_device.py::test_a_producer_with_a_gpu_generates_on_it",),
    ),
    Mutation(
        name="trainer_group_keeps_torchs_timeout",
        why="the trainers' default process group keeps torch's 10-minute timeout instead of --timeout",
        path="colossal_rl/training/booster_plugins.py",
        old="        timeout=datetime.timedelta(seconds=timeout_s),\n    )\n",
        new="    )\n",
        tests=("tests/unit/test_collective_timeouts.py::test_the_trainers_process_group_gets_the_runs_timeout",),
    ),
    Mutation(
        name="nccl_sync_trusts_work_wait",
        why="an NCCL weight-sync collective is waited with Work.wait(timeout), which returns at once: no timeout",
        path="colossal_rl/comm/process_group.py",
        old='        if self.backend == "nccl":\n            self._poll(work, what, self._clock() if enqueued is None else enqueued)\n',
        new="",
        tests=(
            "tests/unit/test_collective_timeouts.py::"
            "test_an_nccl_broadcast_that_never_finishes_times_out_aborts_and_breaks_the_group",
        ),
    ),
    Mutation(
        name="restart_copy_taken_after_the_send",
        why="the restart copy of the weights is taken after the send (on NCCL, queued behind a stuck broadcast)",
        path="colossal_rl/driver/actors.py",
        old="            retained = self._retain(state)\n            if self.sender is not None:\n"
        "                self.sender.send(state, policy_version)\n",
        new="            if self.sender is not None:\n                self.sender.send(state, policy_version)\n"
        "            retained = self._retain(state)\n",
        tests=("tests/unit/test_collective_timeouts.py::test_a_sync_takes_the_restart_copy_before_sending",),
    ),
    Mutation(
        name="nccl_stages_received_concurrently",
        why="a producer receives every pipeline stage at once over several NCCL communicators (can deadlock)",
        path="colossal_rl/comm/weight_sync/bucketed.py",
        old='    if any(receiver.group.backend == "nccl" for receiver in receivers):\n',
        new="    if False:\n",
        tests=(
            "tests/unit/test_stage_receive_order.py::"
            "test_stages_are_received_in_stage_order_over_nccl_and_together_over_gloo[nccl]",
        ),
    ),
    Mutation(
        name="pipeline_gather_of_device_tensors",
        why="every pipeline stage's weights are gathered as device tensors (rebuilt on global rank 0's GPU)",
        path="colossal_rl/training/full_state_dict.py",
        old="    on_host = {name: tensor.detach().cpu() for name, tensor in stage_state_dict.items()}\n",
        new="    on_host = stage_state_dict\n",
        tests=("tests/unit/test_pipeline_gather.py::test_each_stage_reaches_the_gather_on_the_host",),
    ),
    Mutation(
        name="lora_base_read_from_the_engine",
        why="a LoRA sync merges adapters into weights read back from the engine, which a -ptp 2 vLLM engine refuses",
        path="colossal_rl/rollout/producer.py",
        old="            self._lora_base = self.backend.base_weights(targets)\n",
        new="            self._lora_base = {n: t for n, t in self.backend.named_weights().items() if n in targets}\n",
        tests=(
            "tests/unit/test_lora.py::test_a_lora_sync_merges_into_checkpoint_weights_without_reading_a_tensor_parallel_engine",
        ),
    ),
    Mutation(
        name="producer_env_marker_compared_as_tuples",
        why="a built producer environment is never recognised (its JSON marker compared with tuples): rebuilt every run",
        path="colossal_rl/producer_env.py",
        old="    return recorded == json.loads(json.dumps(asdict(spec))) and env_python(directory).exists()  # tuples as lists\n",
        new="    return recorded == asdict(spec) and env_python(directory).exists()\n",
        tests=("tests/unit/test_producer_env.py::test_an_environment_marked_complete_is_found_again_without_building",),
    ),
    Mutation(
        name="stale_cpu_kernel_after_reload",
        why="after vLLM's in-place reload the CPU backend's tied output layer keeps the kernel built from old weights",
        path="colossal_rl/rollout/vllm_weights.py",
        old="        refresh_kept_cpu_kernels(model)\n",
        new="",
        tests=("tests/unit/test_vllm_weights.py::test_a_reload_rebuilds_the_kernels_of_kept_weights",),
    ),
    Mutation(
        name="failed_collective_keeps_its_group",
        why="a member whose broadcast failed keeps its group open: members below a dead one wait out --timeout",
        path="colossal_rl/comm/process_group.py",
        old="            self._release_members()\n",
        new="",
        tests=(
            "tests/unit/test_collective_timeouts.py::"
            "test_a_member_below_a_dead_one_fails_at_once_instead_of_waiting_out_the_timeout",
        ),
    ),
    Mutation(
        name="workers_warm_the_compile_pool",
        why="every trainer and producer starts torch's idle compile-worker processes",
        path="colossal_rl/driver/actors.py",
        old='    os.environ.setdefault(WARM_COMPILE_POOL_VARIABLE, "0")  # before torch._inductor is imported\n',
        new="",
        tests=("tests/unit/test_worker_setup.py::test_a_worker_starts_no_idle_compile_processes",),
    ),
    Mutation(
        name="rounds_ignore_max_steps",
        why="the round schedule runs every planned round: a DAPO run with --max-steps trains past (or short of) it",
        path="colossal_rl/schedule/rounds.py",
        old="max_steps is not None and self._steps_done >= max_steps",
        new="False",
        tests=(
            "tests/unit/test_round_loop_decisions.py::test_max_steps_exactly_met_ends_the_run_at_that_round[4-2]",
            "tests/unit/test_round_schedule.py::test_max_steps_exactly_met_ends_the_run_and_one_short_does_not",
        ),
    ),
    # issue 44: NCCL abort, watchdog order, eager communicator
    Mutation(
        name="nccl_abort_only_torch25",
        why="a timed-out NCCL sync calls only torch 2.5's _shutdown: in torch 2.13 (vLLM workers) the kernel spins on",
        path="colossal_rl/comm/process_group.py",
        old='ABORT_METHODS = ("abort", "_shutdown", "shutdown")\n',
        new='ABORT_METHODS = ("_shutdown",)\n',
        tests=(
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_a_timed_out_broadcast_aborts_with_what_the_torch_offers[abort-abort]",
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_a_timed_out_broadcast_aborts_with_what_the_torch_offers[abort+shutdown-abort]",
            "tests/vllm_engine/test_nccl_abort_torch213.py::test_torch_2_13_offers_the_abort_the_group_picks",
        ),
    ),
    Mutation(
        name="nccl_watchdog_fires_with_our_deadline",
        why="NCCL's watchdog gets our deadline itself: it may end the process before our abort raises",
        path="colossal_rl/comm/process_group.py",
        old="options._timeout = timeout + datetime.timedelta(seconds=WATCHDOG_GRACE_S)",
        new="options._timeout = timeout",
        tests=(
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_our_deadline_aborts_before_the_watchdog_counting_both_from_the_enqueue",
        ),
    ),
    Mutation(
        name="nccl_deadline_counts_from_the_wait",
        why="our NCCL deadline counts from the wait, the watchdog's from the enqueue: a late wait lets it fire first",
        path="colossal_rl/comm/process_group.py",
        old="self._poll(work, what, self._clock() if enqueued is None else enqueued)",
        new="self._poll(work, what, self._clock())",
        tests=(
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_our_deadline_aborts_before_the_watchdog_counting_both_from_the_enqueue",
        ),
    ),
    Mutation(
        name="nccl_communicator_formed_lazily",
        why="the NCCL communicator forms inside the first broadcast, blocking with no deadline (a wedged vLLM worker)",
        path="colossal_rl/comm/process_group.py",
        old="    _form_communicator(process_group, device=device, timeout_s=timeout.total_seconds(), name=name, clock=clock)\n",
        new="",
        tests=(
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_a_communicator_that_never_forms_fails_group_creation_within_the_deadline[StalledBootstrap]",
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_a_communicator_that_never_forms_fails_group_creation_within_the_deadline[WarmUpNeverCompletes]",
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_the_communicator_forms_at_creation_with_one_element_on_the_members_device",
        ),
    ),
    Mutation(
        name="nccl_releases_unchecked",
        why="an NCCL group forms without comparing its members' NCCL releases: NCCL's own hang or abort instead",
        path="colossal_rl/comm/process_group.py",
        old='        if backend == "nccl":\n            _check_nccl_releases(\n',
        new="        if False:\n            _check_nccl_releases(\n",
        tests=(
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_creating_an_nccl_group_checks_releases_before_building_the_process_group",
            "tests/unit/test_nccl_group_lifecycle.py::"
            "test_an_nccl_group_is_built_once_every_member_has_reported_its_release",
        ),
    ),
    # issue 44: one NCCL release by construction, the CUDA 13 driver, a CPU torch in the GPU build, same-node shm
    Mutation(
        name="trainers_skip_the_nccl_preload",
        why="the trainers' actors keep torch 2.5.1's NCCL 2.21.5 on GPUs: no communicator with the producers' 2.29.7",
        path="colossal_rl/driver/actor_groups.py",
        old="    trainer_env = trainer_runtime_env(on_gpu)\n",
        new="    trainer_env = {}\n",
        tests=(
            "tests/unit/test_nccl_release.py::test_on_gpus_trainers_and_transformers_producers_preload_the_same_nccl",
            "tests/unit/test_nccl_release.py::test_vllm_producers_run_their_own_nccl_never_the_trainers_preload",
        ),
    ),
    Mutation(
        name="vllm_producers_get_the_trainers_preload",
        why="vLLM producers (torch 2.13, CUDA 13) start with the trainers' CUDA 12 NCCL preloaded",
        path="colossal_rl/driver/actor_groups.py",
        old='    return trainer_env, (producer_env if backend == "vllm" else trainer_env)\n',
        new="    return trainer_env, trainer_env\n",
        tests=("tests/unit/test_nccl_release.py::test_vllm_producers_run_their_own_nccl_never_the_trainers_preload",),
    ),
    Mutation(
        name="nccl_release_read_from_the_compiled_number",
        why="torch.cuda.nccl.version() is torch 2.5.1's compiled-in 2.21.5: the preload's 2.29.7 is never seen",
        path="colossal_rl/comm/nccl_release.py",
        old="        library = ctypes.CDLL(NCCL_SONAME, mode=os.RTLD_NOLOAD)\n",
        new="        raise OSError\n",
        tests=(
            "tests/contract/test_nccl_release_wheels.py::test_under_the_preload_the_trainers_torch_calls_the_producers_release",
        ),
    ),
    Mutation(
        name="producer_nccl_left_to_vllms_torch",
        why="the GPU producer build no longer pins NCCL: a vLLM bump moves the release away from the trainers' silently",
        path="colossal_rl/producer_env.py",
        old=', f"{PRODUCER_NCCL_PACKAGE}=={NCCL_RELEASE}"),',
        new="),",
        tests=(
            "tests/contract/test_nccl_release_wheels.py::test_the_producers_resolved_set_runs_the_release_and_the_trainers_torch_another",
        ),
    ),
    Mutation(
        name="gpu_build_takes_a_local_cpu_torch",
        why="the GPU producer build's constraints let a local torch-2.13.0+cpu wheel satisfy torch==2.13.0",
        path="colossal_rl/producer_env_constraints_gpu.txt",
        old="\ntorch!=2.13.0+cpu\n",
        new="\n",
        tests=(
            "tests/contract/test_nccl_release_wheels.py::test_the_producers_resolved_set_runs_the_release_and_the_trainers_torch_another",
            "tests/contract/test_nccl_release_wheels.py::test_the_gpu_build_resolves_the_cuda_torch_that_pins_the_release",
        ),
    ),
    Mutation(
        name="cpu_torch_accepted_as_gpu_producers",
        why="the GPU self-check accepts a CPU torch: producers generate on the CPU of a GPU machine, without a word",
        path="colossal_rl/producer_env.py",
        old="    if cuda_version is None:\n",
        new="    if False:\n",
        tests=(
            "tests/unit/test_gpu_driver.py::test_a_gpu_environment_with_a_cpu_torch_is_refused_in_one_line",
            "tests/vllm_engine/test_producer_env_checks.py::"
            "test_a_gpu_self_check_of_an_environment_holding_a_cpu_torch_fails_in_one_line",
        ),
    ),
    Mutation(
        name="cuda_12_driver_accepted",
        why="a driver older than r580 passes: the CUDA 13 torch sees no GPU and vLLM falls back to the CPU",
        path="colossal_rl/nvidia_driver.py",
        old="    if major_minor < MIN_DRIVER_FOR_CUDA_13:\n",
        new="    if major_minor < (525, 0):\n",
        tests=(
            "tests/unit/test_gpu_driver.py::test_a_driver_older_than_r580_is_refused_in_one_line_naming_it[550.54.15]",
            "tests/unit/test_gpu_driver.py::test_building_gpu_producers_on_an_old_driver_stops_before_any_build_step",
        ),
    ),
    Mutation(
        name="gpu_producers_built_without_a_driver_check",
        why="GPU producers are built and started without reading the driver",
        path="colossal_rl/producer_env.py",
        old='    if kind == "gpu":\n        check_gpu_driver()\n',
        new="",
        tests=(
            "tests/unit/test_gpu_driver.py::test_building_gpu_producers_on_an_old_driver_stops_before_any_build_step",
        ),
    ),
    Mutation(
        name="auto_sync_mode_broadcasts_on_gpus",
        why="same-node GPU producers join an NCCL group with the trainers instead of reading shm",
        path="colossal_rl/config.py",
        old='    return "shm" if on_gpu else "broadcast"\n',
        new='    return "broadcast"\n',
        tests=(
            "tests/unit/test_weight_sync_mode_alias.py::test_auto_is_shm_on_gpu_clusters_and_broadcast_on_cpu_ones",
        ),
    ),
    # issue 44: one sync device, receive budget
    Mutation(
        name="engine_test_sender_on_cpu",
        why="the engine test's in-process sender joins on cpu (gloo) while vLLM's workers join on cuda (NCCL): a hang",
        path="tests/vllm_engine/engine_checks.py",
        old="                              device=default_device())  # fmt: skip",
        new='                              device="cpu")  # fmt: skip',
        tests=(
            "tests/unit/test_weight_sync_device.py::"
            "test_the_engine_tests_sender_and_the_vllm_workers_join_over_one_backend[cuda_pretended]",
        ),
    ),
    Mutation(
        name="worker_receives_beyond_vllm_budget",
        why="each vLLM worker allocates an unsharded copy of the weights uncounted: out of memory at the first sync",
        path="colossal_rl/rollout/vllm_worker.py",
        old="before_allocating=vllm_worker_receive.receive_budget_check(self, device),",
        new="before_allocating=None,",
        tests=(
            "tests/unit/test_vllm_worker_receive.py::"
            "test_a_gpu_workers_join_refuses_buffers_that_do_not_fit_before_allocating_them",
        ),
    ),
    # issue 45 item 2: batch-level advantages over the optimizer step
    Mutation(
        name="trainer_skips_the_dp_all_reduce",
        why="each data-parallel rank finishes batch-level advantages over its own share, not the whole step",
        path="colossal_rl/training/trainer.py",
        old="batch = step_advantages(batch, self.config.algorithm, self._sum_over_ranks)",
        new="batch = step_advantages(batch, self.config.algorithm, lambda moments: moments)",
        tests=("tests/unit/test_step_advantages.py::test_the_trainer_finishes_a_step_over_every_data_parallel_share",),
    ),
    Mutation(
        name="producer_finishes_batch_advantages",
        why="producers apply the batch stage over their own batch (a round share, a stream chunk, one group)",
        path="colossal_rl/rollout/postprocess.py",
        old="estimate = group_part(algo.advantage_estimator)",
        new="estimate = batch_stage(algo.advantage_estimator) or group_part(algo.advantage_estimator)",
        tests=(
            "tests/unit/test_postprocess.py::test_token_weighted_estimator_sees_the_response_lengths",
            "tests/unit/test_postprocess.py::test_batch_level_estimators_leave_the_batch_statistics_to_the_trainer",
            "tests/unit/test_step_advantages.py::"
            "test_same_groups_get_the_same_advantages_under_rounds_stream_and_continuous_batching[0-reinforce_ppb]",
            "tests/unit/test_step_advantages.py::test_reinforce_ppb_matches_verl_over_the_whole_step[0]",
        ),
    ),
    Mutation(
        name="trainer_finishes_advantages_per_chunk",
        why="batch-level advantages are finished per chunk of the step (a mini-batch), not once over the step",
        path="colossal_rl/training/trainer.py",
        old="""        batch = step_advantages(batch, self.config.algorithm, self._sum_over_ranks)  # collective for batch-level
        step_loss, totals = self._step_loss(batch)
        new_logprobs: list[torch.Tensor | None] = []
        with self.phases.record("forward_backward"):
            for chunk in self._chunks(batch):
""",
        new="""        step_loss, totals = self._step_loss(batch)
        new_logprobs: list[torch.Tensor | None] = []
        with self.phases.record("forward_backward"):
            for chunk in self._chunks(batch):
                chunk = step_advantages(chunk, self.config.algorithm, self._sum_over_ranks)
""",
        tests=(
            "tests/unit/test_step_advantages.py::test_the_trainer_finishes_a_step_over_every_data_parallel_share",
            "tests/unit/test_step_advantages.py::test_every_optimizer_step_of_a_round_is_finished_over_its_own_batch",
        ),
    ),
    Mutation(
        name="step_advantages_count_masked_out_samples",
        why="the trainer's batch statistics weigh samples outside loss_mask (infra errors, truncated responses)",
        path="colossal_rl/training/step_advantages.py",
        old="weights = stage.weights(batch.advantages, batch.loss_mask, lengths)",
        new="weights = stage.weights(batch.advantages, None, lengths)",
        tests=(
            "tests/unit/test_step_advantages.py::test_the_trainer_finishes_a_step_over_every_data_parallel_share",
            "tests/unit/test_step_advantages.py::"
            "test_same_groups_get_the_same_advantages_under_rounds_stream_and_continuous_batching[0-reinforce_ppb]",
        ),
    ),
    Mutation(
        name="step_moments_summed_over_the_world",
        why="the step's moments are summed over every trainer: tensor-parallel ranks' copies of a share count twice",
        path="colossal_rl/training/trainer.py",
        old="        return torch.tensor(self._global_sums(values.tolist()), dtype=torch.float64)\n",
        new="        tensor = values.to(self.device)\n        dist.all_reduce(tensor)\n        return tensor.cpu()\n",
        tests=("tests/dist/test_step_advantages_ranks.py::test_tensor_parallel_ranks_train_on_the_same_advantages",),
    ),
    # issue 45: one sync orchestrator, loop decisions
    Mutation(
        name="restored_producer_keeps_the_old_group",
        why="a restarted producer is given its weights but the next sync reuses the group it left: it hangs",
        path="colossal_rl/driver/weight_sync.py",
        old="        self.stale = True\n        return self.producers.restore_weights(",
        new="        return self.producers.restore_weights(",
        tests=(
            "tests/unit/test_weight_sync_orchestrator.py::test_a_restarted_producer_alone_loads_the_retained_copy_and_the_next_sync_forms_the_group_again",
        ),
    ),
    Mutation(
        name="producers_receive_before_the_trainers_push",
        why="a sync's receive calls are submitted before the push: the retained copy is read from a producer's result",
        path="colossal_rl/driver/weight_sync.py",
        old="return self.trainers.push_weights(version) + self.producers.receive_weights(version)",
        new="return self.producers.receive_weights(version) + self.trainers.push_weights(version)",
        tests=(
            "tests/unit/test_weight_sync_orchestrator.py::test_a_sync_of_every_producer_pushes_from_the_trainers_first_then_the_producers_receive",
            "tests/unit/test_weight_sync_orchestrator.py::test_a_resume_forms_without_a_copy_then_syncs_every_producer_to_the_checkpoints_version",
        ),
    ),
    Mutation(
        name="synced_copy_not_kept",
        why="a completed sync's retained copy is dropped: a restarted producer gets version 0's weights",
        path="colossal_rl/driver/weight_sync.py",
        old="        if retained:\n            self.retained_weights = retained\n",
        new="",
        tests=(
            "tests/unit/test_weight_sync_orchestrator.py::test_a_resume_forms_without_a_copy_then_syncs_every_producer_to_the_checkpoints_version",
        ),
    ),
    Mutation(
        name="stream_orders_a_second_sync_in_flight",
        why="the schedule loop orders a sync while one is in flight: a trainer overwrites what a producer has not read",
        path="colossal_rl/driver/schedule_loop.py",
        old='        if version is not None and not self._kinds("sync"):\n',
        new="        if version is not None:\n",
        tests=(
            "tests/unit/test_stream_loop_decisions.py::test_one_sync_is_in_flight_at_a_time_and_the_next_one_is_ordered_when_it_answers",
        ),
    ),
    Mutation(
        name="stream_frees_a_usable_chunk",
        why="a chunk exactly S versions stale has its payload freed while its groups may still be trained",
        path="colossal_rl/schedule/streaming.py",
        old="        return self._steps_done - group.policy_version <= self.settings.max_staleness",
        new="        return self._steps_done - group.policy_version < self.settings.max_staleness",
        tests=(
            "tests/unit/test_stream_loop_decisions.py::test_a_chunk_exactly_s_versions_stale_keeps_its_payload_and_one_staler_is_freed[1-kept0]",
        ),
    ),
    Mutation(
        name="stream_loses_a_dead_producers_rows",
        why="a chunk lost with its producer is forgotten without handing its rows out again: they are never trained",
        path="colossal_rl/driver/schedule_loop.py",
        old="                again = self.scheduler.chunk_lost(waiting.subject.chunk_id)\n",
        new="                again = None\n",
        tests=(
            "tests/unit/test_stream_loop_decisions.py::test_a_chunk_lost_with_its_producer_hands_its_rows_out_again_first",
        ),
    ),
    Mutation(
        name="stream_evals_at_the_last_step",
        why="an -ei eval is ordered at the last step too, beside the run's final eval: the same weights twice",
        path="colossal_rl/driver/schedule_loop.py",
        old=" or step < progress.next_eval_step or self.scheduler.finished:",
        new=" or step < progress.next_eval_step:",
        tests=(
            "tests/unit/test_stream_loop_decisions.py::test_the_eval_is_ordered_behind_the_sync_of_exactly_its_step_and_never_at_the_last[3]",
        ),
    ),
    Mutation(
        name="checkpoint_one_step_past_its_interval",
        why="a checkpoint is taken one step after -si is reached, not at it",
        path="colossal_rl/driver/run.py",
        old="return last or self.step // interval > self.last_saved_step // interval",
        new="return last or (self.step - 1) // interval > self.last_saved_step // interval",
        tests=(
            "tests/unit/test_stream_loop_decisions.py::test_a_checkpoint_is_due_when_the_interval_is_exactly_reached_or_at_the_last_step[2-0-False-True]",
        ),
    ),
    Mutation(
        name="rounds_produce_past_the_last",
        why="the round schedule orders one round more than the run trains: its rollouts are generated for nothing",
        path="colossal_rl/schedule/rounds.py",
        old="            and self._next_round < settings.total_rounds\n",
        new="            and self._next_round <= settings.total_rounds\n",
        tests=(
            "tests/unit/test_round_loop_decisions.py::test_the_loop_submits_the_round_schedule_n_behind_rounds_ahead[1]",
        ),
    ),
    Mutation(
        name="rounds_sync_the_version_already_held",
        why="a trained round's steps leave the trainers' version where it was: producers stay a round staler",
        path="colossal_rl/schedule/rounds.py",
        old="        self._step_open = None\n        self.rounds_trained += 1\n",
        new="        self._step_open = None\n",
        tests=(
            "tests/unit/test_round_loop_decisions.py::test_the_loop_submits_the_round_schedule_n_behind_rounds_ahead[0]",
            "tests/unit/test_round_schedule.py::test_exact_orders_carry_over_and_versions",
        ),
    ),
    Mutation(
        name="stream_lag_read_from_n_behind",
        why="a stream run's truncated-IS cap follows -nb instead of --max-staleness: on-policy runs get corrected",
        path="colossal_rl/config.py",
        old='return self.max_staleness if self.mode == "stream" else self.n_behind',
        new="return self.n_behind",
        tests=(
            "tests/unit/test_config_resolve.py::test_every_derived_field_in_each_schedule_follows_that_schedules_lag[stream-3-0-False]",
            "tests/unit/test_config_resolve.py::test_every_derived_field_in_each_schedule_follows_that_schedules_lag[stream-0-1-True]",
        ),
    ),
    Mutation(
        name="round_sync_formed_outside_recovery",
        why="the driver makes a sync (which may form its group again) outside the restart recovery: a producer "
        "dying as the group forms ends a run the restart budget allowed",
        path="colossal_rl/driver/run.py",
        old="""                self.sync.broken()
                groups = None""",
        new="""                self.sync.broken()
                groups = make()""",
        tests=(
            "tests/unit/test_round_loop_decisions.py::test_a_producer_death_while_the_sync_group_forms_again_is_recovered_and_the_sync_made",
        ),
    ),
    Mutation(
        name="stream_sync_formed_outside_recovery",
        why="the schedule loop's remade sync lets a producer death during the group's formation end the run",
        path="colossal_rl/driver/schedule_loop.py",
        old="""            except RunFailed as failure:  # its lost chunks fail in their own waits, and are handed out again
                driver.restarted_producers(failure, [], whole_sync=True)  # raises unless producers were restarted
                if attempt == 2:""",
        new="""            except RunFailed as failure:  # its lost chunks fail in their own waits, and are handed out again
                if True:""",
        tests=(
            "tests/unit/test_stream_loop_decisions.py::test_a_producer_death_while_a_broken_sync_forms_again_is_recovered_then_the_sync_made_again",
        ),
    ),
    Mutation(
        name="reward_worker_outlives_its_parent",
        why="a reward plug-in worker stuck in a call survives its SIGKILLed producer: orphans pile up on the node",
        path="reward/bounded_worker.py",
        old="    die_with_parent(parent_pid)\n",
        new="",
        tests=("tests/unit/test_reward_bounded_calls.py::test_workers_die_with_their_parent",),
    ),
    Mutation(
        name="reward_batch_without_budget",
        why="a batch of many hanging reward calls takes one limit per hang in turn: the producer outlasts --timeout",
        path="reward/bounded_calls.py",
        old="deadline = None if budget_s is None else time.monotonic() + budget_s",
        new="deadline = None",
        tests=("tests/unit/test_reward_bounded_calls.py::test_a_batch_of_many_hanging_samples_ends_within_its_budget",),
    ),
    Mutation(
        name="math_worker_outlives_its_parent",
        why="a math worker stuck on a hostile answer (C code holding the GIL) outlives its killed producer and spins",
        path="reward/math_worker.py",
        old="    die_with_parent(int(sys.argv[1]))",
        new="    pass",
        tests=("tests/unit/test_reward_math.py::test_a_math_worker_stuck_on_a_hostile_answer_dies_with_its_parent",),
    ),
    Mutation(
        name="timeout_message_without_activity",
        why="a late actor is named without what it was doing: a hanging reward looks like a deadlock again",
        path="colossal_rl/driver/calls.py",
        old='names.append(call.name if activity is None else f"{call.actor} ({call.method}; now {activity.describe(now)})")',
        new="names.append(call.name)",
        tests=("tests/unit/test_actor_activity.py::test_the_timeout_message_says_what_each_late_actor_is_doing",),
    ),
    Mutation(
        name="env_errors_not_counted",
        why="episodes whose environment raised are not counted in rollout/env_errors: failures vanish from metrics",
        path="colossal_rl/rollout/multi_turn.py",
        old='"rollout/env_errors": float(sum(bool(e.environment_error) for e in episodes)),',
        new='"rollout/env_errors": 0.0,',
        tests=("tests/unit/test_multi_turn.py::test_environment_errors_are_counted_and_logged_once_per_rollout_batch",),
    ),
    # issue 45: rounds under the one schedule loop
    Mutation(
        name="rounds_lost_chunk_not_made_again",
        why="a round's chunk lost with its producer is not made again: the round never completes and the run stalls",
        path="colossal_rl/schedule/rounds.py",
        old='            raise ValueError(f"chunk {chunk_id} is not in flight")\n        return order\n',
        new='            raise ValueError(f"chunk {chunk_id} is not in flight")\n        return None\n',
        tests=(
            "tests/unit/test_round_schedule.py::test_a_lost_chunk_is_made_again_as_it_was_and_a_finished_one_cannot_be_lost",
            "tests/unit/test_round_loop_decisions.py::test_a_lost_round_chunk_is_made_again_as_it_was_after_the_restarted_producer_gets_its_weights",
        ),
    ),
    Mutation(
        name="rounds_sampled_by_chunk_id",
        why="a round's chunks are seeded by their chunk ids, not the round: a resumed or restarted round samples anew",
        path="colossal_rl/schedule/rounds.py",
        old="ChunkOrder(r * settings.num_producers + rank, rank, episode, rows, self.synced_version, r)",
        new="ChunkOrder(r * settings.num_producers + rank, rank, episode, rows, self.synced_version)",
        tests=(
            "tests/unit/test_round_schedule.py::test_exact_orders_carry_over_and_versions",
            "tests/unit/test_round_loop_decisions.py::test_a_round_is_one_chunk_per_producer_with_its_rows_version_and_seed_and_one_order_of_all_its_steps",
        ),
    ),
    Mutation(
        name="rounds_checkpoint_without_the_round_in_flight",
        why="a round-schedule checkpoint does not wait for the rounds in flight (-nb): their rollouts are lost on resume",
        path="colossal_rl/schedule/rounds.py",
        old="    settles_before_snapshot = True\n",
        new="    settles_before_snapshot = False\n",
        tests=(
            "tests/unit/test_round_loop_decisions.py::test_a_checkpoint_waits_for_the_round_in_flight_and_saves_every_untrained_rollout",
        ),
    ),
    Mutation(
        name="reward_mix_ignores_weights",
        why="--reward-mix adds the components' rewards up unweighted (a 0.2 style bonus counts as much as correctness)",
        path="reward/combined.py",
        old="    total = sum(weight * record.reward for (_, weight), record in zip(components, records, strict=True))\n",
        new="    total = sum(record.reward for record in records)\n",
        tests=(
            "tests/unit/test_reward_mix.py::test_the_reward_is_the_weighted_sum_and_the_first_component_decides_status",
            "tests/unit/test_reward_mix.py::test_a_producer_logs_each_components_mean[None]",
        ),
    ),
    Mutation(
        name="reward_mix_hides_a_later_components_infra_error",
        why="only the first --reward-mix component's infra_error masks a sample: a crashed judge scores 0 and is trained on",
        path="reward/combined.py",
        old="    for (name, _), record in zip(components, records, strict=True):\n        if record.status == INFRA_ERROR:\n",
        new="    for (name, _), record in zip(components[:1], records[:1], strict=True):\n        if record.status == INFRA_ERROR:\n",
        tests=("tests/unit/test_reward_mix.py::test_a_component_that_cannot_score_makes_the_sample_an_infra_error",),
    ),
    # issue 47: rewards from models
    Mutation(
        name="remote_reward_gives_up_on_a_restarted_actor",
        why="a producer's request to a reward actor that died is not sent again: its samples are lost to a restart",
        path="colossal_rl/comm/remote_reward.py",
        old="                continue\n",
        new="                break\n",
        tests=("tests/unit/test_remote_reward.py::test_a_dead_actor_is_asked_again_and_every_sample_is_scored_once",),
    ),
    Mutation(
        name="reward_batcher_waits_with_every_caller_in",
        why="a reward actor waits out its window though every producer it serves has a request in: each pass slower",
        path="reward/request_batching.py",
        old="while size < self.max_batch and len(batch) < (self.max_callers or len(batch) + 1):",
        new="while size < self.max_batch:",
        tests=(
            "tests/unit/test_request_batching.py::test_a_batch_holding_a_request_of_every_caller_is_scored_without_waiting",
        ),
    ),
    Mutation(
        name="moe_replay_forces_nothing",
        why="routing replay records routes but the trainer's router still chooses: flipped near-ties move log-probs",
        path="colossal_rl/moe/routing.py",
        old="        selected = torch.where(replayed[:, None], forced.long(), own)\n",
        new="        selected = own\n",
        tests=(
            "tests/unit/test_moe_routing_replay.py::test_flipped_near_ties_move_the_logprobs_without_replay_and_not_with_it[packed]",
            "tests/unit/test_moe_routing_replay.py::test_flipped_near_ties_move_the_logprobs_without_replay_and_not_with_it[shared_prompt]",
        ),
    ),
    Mutation(
        name="moe_prompt_routes_not_laid_out",
        why="block layouts replay the prompt's routes at the wrong positions (response routes only)",
        path="colossal_rl/training/sequence_layout.py",
        old="            [prompt_values.reshape(-1, *trailing), response_values.reshape(-1, *trailing),",
        new="            [torch.full_like(prompt_values, fill).reshape(-1, *trailing), response_values.reshape(-1, *trailing),",
        tests=(
            "tests/unit/test_moe_routing_replay.py::test_flipped_near_ties_move_the_logprobs_without_replay_and_not_with_it[packed]",
        ),
    ),
    Mutation(
        name="moe_response_routes_off_by_one",
        why="the producer files each fed token's experts under the next response position",
        path="colossal_rl/rollout/decoding.py",
        old="            response_routes[running[fed], step] = session.recorded(len(running), 1, route_dtype)[fed, 0]",
        new="            response_routes[running[fed], min(step + 1, response_routes.shape[1] - 1)] = session.recorded(len(running), 1, route_dtype)[fed, 0]",
        tests=(
            "tests/unit/test_moe_routing_replay.py::test_the_recorded_routes_are_the_sampling_forwards_own_choices",
            "tests/unit/test_moe_routing_replay.py::test_the_recorded_routes_are_what_a_full_forward_at_the_same_weights_chooses",
        ),
    ),
    Mutation(
        name="moe_gate_weights_not_renormalised",
        why="forced experts keep their raw softmax weights under norm_topk_prob: replay changes the forward",
        path="colossal_rl/moe/routing.py",
        old="    if normalize:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        new="    if normalize and forced is None:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        tests=(
            "tests/unit/test_moe_routing_replay.py::test_same_weights_the_trainer_recomputes_the_behaviour_logprobs_with_and_without_replay[padded]",
        ),
    ),
    Mutation(
        name="vllm_prefix_cache_kept_after_a_load",
        why="the engine's prefix cache is not emptied after a weight load: samples continued mid-flight reuse KV blocks of the old weights",
        path="colossal_rl/rollout/vllm_backend.py",
        old="        if not self.llm.reset_prefix_cache():",
        new="        if False:",
        tests=(
            "tests/vllm_engine/test_vllm_engine.py::test_partial_rollouts_sampled_tokens_keep_the_log_probs_of_the_version_that_sampled_them",
            "tests/vllm_engine/test_vllm_engine.py::test_partial_rollouts_greedy_tokens_after_a_workers_load_are_the_new_weights_continuation",
        ),
    ),
    Mutation(
        name="vllm_partial_tokens_labelled_with_admission_version",
        why="vLLM partial rollouts label every token with its group's admission version: tokens after a load carry the old one",
        path="colossal_rl/rollout/vllm_partial_rollouts.py",
        old="            sample.versions += [self.policy_version] * len(tokens)",
        new="            sample.versions += [group.policy_version] * len(tokens)",
        tests=(
            "tests/unit/test_vllm_partial_rollouts.py::test_samples_at_different_depths_go_on_from_their_tokens_under_the_new_weights[sampled]",
            "tests/unit/test_vllm_partial_rollouts.py::test_rows_carry_each_tokens_version_and_other_requests_run_beside",
        ),
    ),
    Mutation(
        name="vllm_partial_continues_without_its_tokens",
        why="a sample stopped for a load starts over from its prompt instead of going on from its tokens so far",
        path="colossal_rl/rollout/vllm_partial_rollouts.py",
        old='        return {"prompt_token_ids": self.prompt + self.tokens}, params',
        new='        return {"prompt_token_ids": self.prompt}, params',
        tests=(
            "tests/unit/test_vllm_partial_rollouts.py::test_samples_at_different_depths_go_on_from_their_tokens_under_the_new_weights[greedy]",
            "tests/unit/test_vllm_partial_rollouts.py::test_each_sample_goes_on_as_its_own_request_with_what_is_left_and_a_new_seed",
        ),
    ),
    Mutation(
        name="decode_attention_wrong_kv_head",
        why="the decode step's query heads read the wrong key/value head (h % groups instead of h // groups)",
        path="colossal_rl/rollout/gqa_decode_attention.py",
        old="    grouped = query.reshape(batch, heads // groups, groups, dim)  # query head h reads key/value head h // groups",
        new="    grouped = query.reshape(batch, groups, heads // groups, dim).transpose(1, 2).reshape(batch, heads // groups, groups, dim)",
        tests=(
            "tests/unit/test_gqa_decode_attention.py::test_one_decode_position_equals_transformers_attention_with_its_mask",
            "tests/unit/test_gqa_decode_attention.py::test_sampling_through_it_gives_the_same_tokens_and_logprobs",
        ),
    ),
    Mutation(
        name="receive_budget_leaves_out_the_reload_copy",
        why="a vLLM worker's receive budget leaves out vLLM's layer-by-layer reload copy of the largest tensor",
        path="colossal_rl/rollout/vllm_worker_receive.py",
        old="    needed = receive_bytes + largest_tensor_bytes + headroom_bytes\n",
        new="    needed = receive_bytes + headroom_bytes\n",
        tests=(
            "tests/unit/test_vllm_worker_receive.py::"
            "test_the_budget_counts_vllms_reload_copy_of_the_largest_tensor_at_the_boundary",
        ),
    ),
    Mutation(
        name="served_reward_models_load_in_fp32_on_gpus",
        why="reward models and local judges load in float32 on GPUs (twice the memory of the trainers' bf16)",
        path="reward/model_rewards.py",
        old='    return "bfloat16" if device.split(":")[0] == "cuda" else "float32"\n',
        new='    return "float32"\n',
        tests=(
            "tests/unit/test_model_reward_config.py::"
            "test_a_served_scorer_built_for_a_device_loads_its_model_in_that_devices_dtype[cuda-bfloat16]",
        ),
    ),
    Mutation(
        name="one_gpu_check_needs_the_project_installed",
        why="the one-GPU check's transformers-producer check imports colossal_rl.reward, which only an install maps",
        path="tests/gpu/one_gpu_check.py",
        old="        reward_package_from_checkout()\n        result = run()\n",
        new="        result = run()\n",
        tests=(
            "tests/unit/test_one_gpu_check.py::"
            "test_the_transformers_producer_check_runs_from_a_checkout_that_is_not_installed",
        ),
    ),
    Mutation(
        name="shm_region_is_truncated_not_reserved",
        why="the shm sender truncates its region instead of reserving it: SIGBUS at the first write on a small tmpfs",
        path="colossal_rl/comm/weight_sync/shared_memory.py",
        old="        reserve(data_path, size)  # first: a region that does not fit leaves nothing behind\n",
        new='        with open(data_path, "wb") as file:\n            file.truncate(size)\n',
        tests=(
            "tests/unit/test_weight_sync_modes.py::test_shm_sender_reserves_the_regions_space_up_front",
            "tests/unit/test_weight_sync_modes.py::"
            "test_shm_sender_refuses_a_region_its_file_system_has_no_room_for_in_one_line",
            "tests/unit/test_weight_sync_modes.py::test_shm_sender_turns_enospc_from_the_reservation_into_the_same_refusal",
        ),
    ),
    Mutation(
        name="auto_sync_mode_ignores_dev_shm_room",
        why="--weight-sync-mode auto picks shm on GPUs even where the trainers' /dev/shm cannot hold the region",
        path="colossal_rl/driver/placement.py",
        old='            mode = "broadcast"\n',
        new="            pass\n",
        tests=(
            "tests/unit/test_weight_sync_mode_alias.py::"
            "test_auto_takes_the_broadcast_where_the_region_does_not_fit_a_trainer_nodes_dev_shm",
        ),
    ),
    Mutation(
        name="driver_version_read_on_the_drivers_machine",
        why="the NVIDIA driver is read where the driver runs (a CPU-only head), not on the GPU producers' nodes",
        path="colossal_rl/nvidia_driver.py",
        old="    versions = run(read_driver_version, nodes, (), timeout_s)\n",
        new="    versions = [read_driver_version() for _ in nodes]\n",
        tests=(
            "tests/unit/test_gpu_node_checks.py::"
            "test_a_head_without_a_driver_does_not_stop_gpu_producers_whose_nodes_have_r580",
            "tests/unit/test_gpu_node_checks.py::test_a_gpu_producer_node_with_an_old_driver_is_named",
        ),
    ),
    Mutation(
        name="trainer_nccl_preload_unchecked_per_node",
        why="the trainers' NCCL preload is a path on the driver's machine, never checked on the trainers' nodes",
        path="colossal_rl/driver/node_checks.py",
        old="        check_trainer_nccl_on_nodes(library, nodes_of(in_trainer_env), timeout_s, run)\n",
        new="        pass\n",
        tests=(
            "tests/unit/test_gpu_node_checks.py::"
            "test_a_head_without_a_driver_does_not_stop_gpu_producers_whose_nodes_have_r580",
            "tests/unit/test_gpu_node_checks.py::test_a_trainer_node_where_the_preload_is_missing_or_ignored_is_named",
        ),
    ),
    Mutation(
        name="auto_backend_asks_producers_about_own_code_models",
        why="--trainer-backend auto ignores --trust-remote-code: a model with its own code is sent to fsdp2 or refused",
        path="colossal_rl/driver/trainer_backend.py",
        old="    if model_type is None or own_code or model_type in trainers_types:\n",
        new="    if model_type is None or model_type in trainers_types:\n",
        tests=("tests/unit/test_trainer_backend.py::test_own_code_models_stay_on_colossalai",),
    ),
    Mutation(
        name="auto_backend_skips_fsdp2_refusals",
        why="a backend resolved from auto is not validated again: fsdp2 takes -pp, -zero, -tp and fp16 silently",
        path="colossal_rl/driver/trainer_backend.py",
        old="    parallel.validate()  # fsdp2's refusals (-pp, -zero, fp16) name the flag\n",
        new="",
        tests=(
            "tests/unit/test_trainer_backend.py::"
            "test_auto_choosing_fsdp2_still_refuses_what_fsdp2_cannot_do_naming_the_flag[parallel0-parallel.pp_size]",
            "tests/unit/test_trainer_backend.py::"
            "test_auto_choosing_fsdp2_still_refuses_what_fsdp2_cannot_do_naming_the_flag"
            "[parallel1-parallel.zero_stage]",
            "tests/unit/test_trainer_backend.py::"
            "test_auto_choosing_fsdp2_still_refuses_what_fsdp2_cannot_do_naming_the_flag[parallel2-parallel.tp_size]",
            "tests/unit/test_trainer_backend.py::"
            "test_auto_choosing_fsdp2_still_refuses_what_fsdp2_cannot_do_naming_the_flag[parallel3-parallel.precision]",
        ),
    ),
    Mutation(
        name="fsdp2_accepts_zero_stage_1",
        why="fsdp2's refusal of a ZeRO stage lets stage 1 through (off by one), a flag that means nothing there",
        path="colossal_rl/config.py",
        old="            self.zero_stage == 0,\n",
        new="            self.zero_stage <= 1,\n",
        tests=(
            "tests/unit/test_trainer_backend.py::"
            "test_auto_choosing_fsdp2_still_refuses_what_fsdp2_cannot_do_naming_the_flag"
            "[parallel1-parallel.zero_stage]",
        ),
    ),
    Mutation(
        name="sliding_window_layer_types_ignored",
        why="a model whose layers all use full attention is taken for a sliding-window one (trains padded needlessly)",
        path="colossal_rl/training/micro_batch_forward.py",
        old='    return layer_types is None or "sliding_attention" in layer_types\n',
        new="    return True\n",
        tests=(
            "tests/unit/test_layout_choice.py::"
            "test_a_sliding_window_model_trains_padded_and_an_asked_block_layout_is_refused",
        ),
    ),
    Mutation(
        name="sliding_window_off_without_its_flag",
        why="a config without use_sliding_window (OLMo 3) is read as windowless: block masks attend past its window",
        path="colossal_rl/training/micro_batch_forward.py",
        old='getattr(text, "use_sliding_window", True) is False',
        new='not getattr(text, "use_sliding_window", False)',
        tests=(
            "tests/unit/test_layout_choice.py::test_a_config_without_a_use_sliding_window_flag_attends_in_its_window",
        ),
    ),
    Mutation(
        name="sliding_window_refusal_swapped",
        why="the sliding-window branch is swapped: an asked packed layout is kept and auto is refused",
        path="colossal_rl/training/micro_batch_forward.py",
        old='            if config.train.sequence_layout != "auto":\n',
        new='            if config.train.sequence_layout == "auto":\n',
        tests=(
            "tests/unit/test_layout_choice.py::"
            "test_a_sliding_window_model_trains_padded_and_an_asked_block_layout_is_refused",
        ),
    ),
    Mutation(
        name="unknown_moe_refused_without_its_flags",
        why="a GLM-4 MoE is refused at --router-aux-loss-coef 0 (>= 0 for > 0): only Qwen3's MoE trains",
        path="colossal_rl/moe/support.py",
        old="(routing_replay or router_aux_loss_coef > 0)",
        new="(routing_replay or router_aux_loss_coef >= 0)",
        tests=(
            "tests/unit/test_moe_support.py::"
            "test_replay_on_a_dense_model_and_an_unknown_moe_are_refused_and_an_unknown_moe_trains_without_them",
        ),
    ),
    Mutation(
        name="auto_shm_room_equal_to_the_region_is_short",
        why="--weight-sync-mode auto takes the broadcast where /dev/shm has exactly the region's room (<= for <)",
        path="colossal_rl/driver/placement.py",
        old="if room < needed",
        new="if room <= needed",
        tests=(
            "tests/unit/test_weight_sync_mode_alias.py::"
            "test_a_dev_shm_exactly_the_regions_size_fits_and_one_byte_less_does_not[auto-2]",
            "tests/unit/test_weight_sync_mode_alias.py::"
            "test_a_dev_shm_exactly_the_regions_size_fits_and_one_byte_less_does_not[fp32-4]",
        ),
    ),
    Mutation(
        name="auto_shm_region_sized_as_on_the_cpu",
        why="the shm room check resolves auto precision as on the CPU (fp32): twice the region GPU trainers send",
        path="colossal_rl/driver/placement.py",
        old="resolve_precision(config.parallel.precision, on_gpu=True)",
        new="resolve_precision(config.parallel.precision, on_gpu=False)",
        tests=(
            "tests/unit/test_weight_sync_mode_alias.py::"
            "test_a_dev_shm_exactly_the_regions_size_fits_and_one_byte_less_does_not[auto-2]",
        ),
    ),
    Mutation(
        name="auto_shm_fp32_region_sized_in_bf16",
        why="the shm room check counts two bytes a parameter under fp32: auto picks shm where the region cannot fit",
        path="colossal_rl/driver/placement.py",
        old='(4 if precision == "fp32" else 2)',
        new="2",
        tests=(
            "tests/unit/test_weight_sync_mode_alias.py::"
            "test_a_dev_shm_exactly_the_regions_size_fits_and_one_byte_less_does_not[fp32-4]",
        ),
    ),
    Mutation(
        name="shm_sender_refuses_exactly_enough_room",
        why="the shm sender refuses a file system whose free space equals its region (<= for <)",
        path="colossal_rl/comm/weight_sync/shared_memory.py",
        old="    if available < size:\n",
        new="    if available <= size:\n",
        tests=(
            "tests/unit/test_weight_sync_modes.py::test_shm_sender_takes_a_file_system_with_exactly_the_regions_room",
        ),
    ),
    Mutation(
        name="due_sync_formation_failure_skips_restarts",
        why="a producer death while a due sync forms its group is retried without restarting it (or ending the run)",
        path="colossal_rl/driver/schedule_loop.py",
        old="                if self.driver.restarted_producers(failure, [], whole_sync=True):  # raises unless some restarted\n",
        new="                if True:\n",
        tests=(
            "tests/unit/test_round_loop_decisions.py::"
            "test_a_producer_death_while_a_due_sync_forms_its_group_again_is_recovered_and_the_schedule_unchanged",
        ),
    ),
    Mutation(
        name="chunk_lost_in_a_formation_made_again_after_the_sync",
        why="a chunk lost with a producer that died as a due sync formed goes out after that sync (new weights)",
        path="colossal_rl/driver/schedule_loop.py",
        old="                        self._redo_lost(waiting)  # before this sync: a lost chunk is made at its own version\n",
        new="                        pass\n",
        tests=(
            "tests/unit/test_round_loop_decisions.py::"
            "test_a_chunk_lost_with_a_producer_that_died_as_a_due_sync_formed_is_made_again_before_that_sync",
        ),
    ),
    Mutation(
        name="formation_not_abandoned",
        why="the trainer hosting a sync group waits out --timeout for a member that died, its call cancelled",
        path="colossal_rl/comm/process_group.py",
        old="        if abandoned():\n",
        new="        if False:\n",
        tests=(
            "tests/unit/test_group_formation.py::"
            "test_the_host_of_a_group_a_member_never_joins_stops_waiting_once_the_formation_is_abandoned",
        ),
    ),
    Mutation(
        name="failed_formation_not_cancelled",
        why="a formation a producer died in is left running: its host waits for the dead member until --timeout",
        path="colossal_rl/driver/weight_sync.py",
        old="            self.cancel([call for calls in formation for call in calls])\n",
        new="",
        tests=(
            "tests/unit/test_weight_sync_orchestrator.py::"
            "test_a_formation_a_producer_died_in_cancels_all_its_calls_and_stays_to_be_formed",
        ),
    ),
    Mutation(
        name="fsdp2_trainer_nodes_driver_unchecked",
        why="under fsdp2 only the producers' nodes are checked for r580+, not the trainers' (CUDA 13 torch there too)",
        path="colossal_rl/driver/node_checks.py",
        old="nodes_of(placement.producers + placement.trainers)",
        new="nodes_of(placement.producers)",
        tests=(
            "tests/unit/test_gpu_node_checks.py::"
            "test_fsdp2_asks_every_gpu_actors_node_for_the_driver_and_none_for_the_trainers_nccl",
        ),
    ),
    Mutation(
        name="fsdp2_trainers_checked_for_colossalai_nccl",
        why="under fsdp2 the ColossalAI trainers' NCCL preload is still demanded of the trainers' nodes",
        path="colossal_rl/driver/node_checks.py",
        old="        check_driver_on_nodes(nodes_of(placement.producers + placement.trainers), timeout_s, run)\n"
        "        return\n",
        new="        check_driver_on_nodes(nodes_of(placement.producers + placement.trainers), timeout_s, run)\n",
        tests=(
            "tests/unit/test_gpu_node_checks.py::"
            "test_fsdp2_asks_every_gpu_actors_node_for_the_driver_and_none_for_the_trainers_nccl",
        ),
    ),
    Mutation(
        name="engine_auto_swapped",
        why="a trainer built with auto takes fsdp2 where ColossalAI is installed and colossalai where it is not",
        path="colossal_rl/training/engines/__init__.py",
        old='importlib.util.find_spec("colossalai") is not None else "fsdp2"',
        new='importlib.util.find_spec("colossalai") is None else "fsdp2"',
        tests=(
            "tests/unit/test_trainer_backend.py::"
            "test_a_trainer_built_outside_a_run_with_auto_takes_colossalai_where_installed_else_fsdp2",
        ),
    ),
    Mutation(
        name="vllm_worker_reverts_names_it_holds",
        why="a vLLM worker builds the checkpoint-format revert at every sync (it fails in vLLM's Transformers backend)",
        path="colossal_rl/rollout/vllm_weights.py",
        old="    if unknown:  # names of transformers 5's in-memory layout",
        new="    if True:  # names of transformers 5's in-memory layout",
        tests=(
            "tests/unit/test_vllm_weights.py::test_a_worker_reverts_to_checkpoint_names_only_names_it_does_not_hold",
        ),
    ),
    Mutation(
        name="vllm_worker_reverted_names_not_retargeted",
        why="after reverting fused names a vLLM worker checks the names it was sent, not the reverted ones",
        path="colossal_rl/rollout/vllm_weights.py",
        old="        targets = {name: vllm_parameter_name(name, architecture) for name, _ in weights}\n"
        "        unknown = unknown_of(targets)\n    if unknown:\n        raise",
        new="        unknown = unknown_of(targets)\n    if unknown:\n        raise",
        tests=(
            "tests/unit/test_vllm_weights.py::test_a_worker_reverts_to_checkpoint_names_only_names_it_does_not_hold",
        ),
    ),
    Mutation(
        name="model_size_counts_safetensors_metadata",
        why="the parameter count reads safetensors' __metadata__ as a tensor: size unknown, shm room never checked",
        path="colossal_rl/model_size.py",
        old=' if name != "__metadata__"',
        new="",
        tests=(
            "tests/unit/test_weight_sync_mode_alias.py::"
            "test_auto_takes_the_broadcast_where_the_region_does_not_fit_a_trainer_nodes_dev_shm",
        ),
    ),
)

# Records every test phase's outcome as a JSON line; loaded into pytest with ``-p``.
_REPORTER = """
import json, os

def pytest_runtest_logreport(report):
    with open(os.environ["MUTATION_CHECK_REPORT"], "a") as out:
        out.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}) + "\\n")
"""


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str
    """``caught``, ``MISSED``, ``ERROR``, or for the baseline ``passed`` / ``FAILED``."""
    detail: str
    seconds: float


def copy_repository(destination: Path) -> Path:
    """An importable copy of the checkout: ``colossal_rl.reward`` resolves to the copy's ``reward/`` too."""
    copy = destination / "repo"
    shutil.copytree(REPO, copy, ignore=COPY_IGNORE, symlinks=True)
    # The editable install maps colossal_rl.reward to the original reward/; this link, found first on the
    # copy's path, makes the copy import its own (possibly mutated) reward package.
    (copy / "colossal_rl" / "reward").symlink_to(Path("..") / "reward", target_is_directory=True)
    return copy


def environment(copy: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    # PYTHONPATH reaches every process the tests start (spawned workers, Ray actors, rl_example.py runs).
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(work), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MUTATION_CHECK_REPORT"] = str(work / "report.jsonl")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("WANDB_MODE", "disabled")
    producer_python = built_producer_python()
    if producer_python is not None:
        env.setdefault("COLOSSAL_RL_PRODUCER_PYTHON", producer_python)
    return env


def built_producer_python() -> str | None:
    """The producers' environment already built for this checkout, if any. A copy is another checkout, so its vLLM
    tests would otherwise build a fresh environment (minutes) around a temporary directory that is then deleted;
    with the copy first on ``PYTHONPATH`` this one runs the copy's code."""
    from colossal_rl.producer_env import detect_kind, env_dir, env_python, is_complete, spec_for

    spec = spec_for(detect_kind(), root=REPO)
    directory = env_dir(spec)
    return str(env_python(directory)) if is_complete(directory, spec) else None


def check_imports_from(copy: Path, env: dict[str, str]) -> None:
    """Refuse to go on if the copy would import the original checkout's code."""
    code = "import colossal_rl, colossal_rl.reward; print(colossal_rl.__file__); print(colossal_rl.reward.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the copy does not import: {done.stderr[-2000:]}")
    for path in done.stdout.split():
        if not Path(path).resolve().is_relative_to(copy.resolve()):
            raise RuntimeError(f"the copy imports {path}, outside {copy}")


def run_tests(copy: Path, work: Path, tests: tuple[str, ...]) -> tuple[dict[str, str], str]:
    """Run ``tests`` in ``copy``; returns node id -> ``passed``/``failed``/``skipped`` and pytest's output tail."""
    (work / "_mutation_check_reporter.py").write_text(_REPORTER)
    env = environment(copy, work)
    check_imports_from(copy, env)
    report = Path(env["MUTATION_CHECK_REPORT"])
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_mutation_check_reporter"]
    try:
        done = subprocess.run([*command, *tests], cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        tail = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        tail = f"pytest did not finish within {TIMEOUT_S}s"
    phases: dict[str, set[str]] = {}  # node id -> outcomes of its setup, call and teardown
    for line in report.read_text().splitlines() if report.exists() else []:
        record = json.loads(line)
        phases.setdefault(record["nodeid"], set()).add(record["outcome"])
    outcomes = {}
    for node, seen in phases.items():
        outcomes[node] = next(outcome for outcome in ("failed", "skipped", "passed") if outcome in seen)
    return outcomes, tail


def apply(mutation: Mutation, copy: Path) -> str | None:
    """Make the change in ``copy``; an error message when ``old`` does not occur exactly once."""
    path = copy / mutation.path
    if not path.is_file():
        return f"{mutation.path}: no such file"
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        return f"{mutation.path}: the old text occurs {count} times (expected once): {mutation.old.strip()[:80]!r}"
    path.write_text(text.replace(mutation.old, mutation.new))
    return None


def judge(mutation: Mutation, outcomes: dict[str, str], tail: str) -> tuple[str, str]:
    missing = [test for test in mutation.tests if test not in outcomes]
    if missing:
        return "ERROR", f"not run (check the node ids): {missing}\n{textwrap.indent(tail, '    ')}"
    survivors = [test for test in mutation.tests if outcomes[test] != "failed"]
    if survivors:
        return "MISSED", "still " + ", ".join(f"{outcomes[t]}: {t}" for t in survivors)
    return "caught", f"{len(mutation.tests)} test(s) failed"


def check_mutation(mutation: Mutation) -> Verdict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as work_dir:
        work = Path(work_dir)
        copy = copy_repository(work)
        problem = apply(mutation, copy)
        if problem is not None:
            return Verdict(mutation.name, "ERROR", problem, time.monotonic() - started)
        outcomes, tail = run_tests(copy, work, mutation.tests)
        status, detail = judge(mutation, outcomes, tail)
    return Verdict(mutation.name, status, detail, time.monotonic() - started)


def check_baseline(mutations: list[Mutation]) -> Verdict:
    """Every listed test passes on an unmutated copy."""
    started = time.monotonic()
    tests = tuple(dict.fromkeys(test for mutation in mutations for test in mutation.tests))
    with tempfile.TemporaryDirectory(prefix="mutation-baseline-") as work_dir:
        work = Path(work_dir)
        copy = copy_repository(work)
        outcomes, tail = run_tests(copy, work, tests)
    failing = [f"{outcomes.get(test, 'not run')}: {test}" for test in tests if outcomes.get(test) != "passed"]
    status = "FAILED" if failing else "passed"
    detail = "\n    ".join(failing) + f"\n{textwrap.indent(tail, '    ')}" if failing else f"{len(tests)} tests passed"
    return Verdict("baseline", status, detail, time.monotonic() - started)


def select(names: list[str] | None, unit_only: bool) -> list[Mutation]:
    if unit_only:
        return [mutation for mutation in MUTATIONS if all(test.startswith("tests/unit/") for test in mutation.tests)]
    if not names:
        return list(MUTATIONS)
    known = {mutation.name: mutation for mutation in MUTATIONS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; known: {', '.join(known)}")
    return [known[name] for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--unit-only", action="store_true", help="only mutations whose tests are all in tests/unit")
    parser.add_argument("--no-baseline", action="store_true", help="skip checking that the tests pass unmutated")
    args = parser.parse_args(argv)
    if len({mutation.name for mutation in MUTATIONS}) != len(MUTATIONS):
        raise SystemExit("two mutations share a name")
    if args.unit_only and args.only:
        raise SystemExit("--unit-only and --only exclude each other")
    mutations = select(args.only, args.unit_only)
    if args.list:
        for mutation in mutations:
            print(f"{mutation.name}: {mutation.why}\n    {mutation.path}")
            for test in mutation.tests:
                print(f"    must fail: {test}")
        return 0

    started = time.monotonic()
    verdicts = []
    if not args.no_baseline:
        verdicts.append(check_baseline(mutations))
        print(f"{verdicts[-1].status:8} baseline ({verdicts[-1].seconds:.0f} s): {verdicts[-1].detail}", flush=True)
    for mutation in mutations:
        verdicts.append(check_mutation(mutation))
        verdict = verdicts[-1]
        print(f"{verdict.status:8} {verdict.name} ({verdict.seconds:.0f} s): {verdict.detail}", flush=True)
    good = sum(v.status in ("caught", "passed") for v in verdicts)
    caught = sum(v.status == "caught" for v in verdicts)
    print(f"{caught} of {len(mutations)} mutations caught; {len(verdicts) - good} problem(s); "
          f"{time.monotonic() - started:.0f} s in total")  # fmt: skip
    return 0 if good == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
