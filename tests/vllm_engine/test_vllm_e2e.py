"""``rl_example.py -b vllm`` end to end: producers on the real vLLM engine in their own environment (torch 2.13,
transformers 5), trainers on ColossalAI's stack (torch 2.5.1), weights crossing the two over the gloo weight sync.

- The default run with ``-b vllm`` learns like the default run (eval lift >= ``DEFAULT_RUN_MIN_GAIN``).
- A fully on-policy run (``-nb 0``): at every step the trainer's recomputed log-probs equal vLLM's behaviour
  log-probs (every sync reached the engine), also after a producer was killed and restarted by Ray.
- The embedded tiny VLM on the shapes task (image prompts through the engine): a few fully on-policy steps, trainer
  and vLLM log-probs equal at each (every sync, vision tower included, reached the engine).
- Bad input: no producer environment, one clear line and no hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_processes import marked_env, new_marker

from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN_MIN_GAIN = 0.25
ON_POLICY_MAX_LOGPROB_DIFF = 1e-3
"""Mean |log p_trainer - log p_vLLM| over a step's tokens with both at the same weights (fp32); a missed sync
shows up as ~1e-2 or more after one optimizer step."""

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.dist]

sys.path.insert(0, str(REPO / "tests" / "e2e"))
from test_lifecycle_e2e import Run  # noqa: E402  (the background run with its marked processes)


def run_dir_in(save_dir: Path) -> Path:
    (run_dir,) = [p for p in save_dir.iterdir() if p.is_dir()]
    return run_dir


def test_the_default_run_on_vllm_learns(producer_python, tmp_path):
    command = [sys.executable, "rl_example.py", "-b", "vllm", "--no-wandb", "-sd", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=marked_env(new_marker()), capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_metrics(run_dir_in(tmp_path) / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    start, end = evals[0]["eval/math_accuracy"], evals[-1]["eval/math_accuracy"]
    assert end >= start + DEFAULT_RUN_MIN_GAIN, f"eval accuracy {start} -> {end}"


def test_on_policy_logprobs_match_every_step_also_after_a_producer_restart(producer_python, tmp_path):
    run = Run([
        sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "-nb", "0", "--max-steps", "8",
        "-ei", "0", "--max-actor-restarts", "1", "--timeout", "300", "-sd", str(tmp_path),
    ])  # fmt: skip
    run.wait_for(lambda: "optimizer steps:" in run.output, "training started", timeout_s=600)
    pid = run.wait_for(lambda: min(run.actor_pids(), default=None), "a producer process")
    os.kill(pid, signal.SIGKILL)
    assert run.finish(timeout_s=900) == 0, run.output[-4000:]
    assert "died and was restarted (1 of --max-actor-restarts 1)" in run.output
    train = [r for r in read_metrics(run_dir_in(tmp_path) / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    diffs = [r["off_policy/logprob_abs_diff"] for r in train]
    assert max(diffs) < ON_POLICY_MAX_LOGPROB_DIFF, diffs
    assert all(r["train/staleness"] == 0 for r in train)


def test_a_missing_producer_environment_is_one_clear_line(tmp_path):
    missing = tmp_path / "no-such-env" / "bin" / "python"
    env = marked_env(new_marker()) | {"COLOSSAL_RL_PRODUCER_PYTHON": str(missing)}
    done = subprocess.run([sys.executable, "rl_example.py", "-b", "vllm", "--no-wandb", "-sd", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(missing) in errors[0], done.stderr[-2000:]


def test_an_engine_that_dies_mid_run_restarts_its_producer_and_the_run_finishes(producer_python, tmp_path):
    """The engine core is a child process of the producer: killed, the producer's watchdog says so in one line and
    ends the producer, which Ray restarts with a new engine and the current weights; the run finishes."""
    from run_processes import processes_of_run

    run = Run([
        sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "--max-steps", "6", "-ei", "0",
        "--max-actor-restarts", "1", "--timeout", "300", "-sd", str(tmp_path),
    ])  # fmt: skip
    run.wait_for(lambda: "optimizer steps:" in run.output, "training started", timeout_s=600)
    engines = run.wait_for(
        lambda: [pid for pid, command in processes_of_run(run.marker).items() if "EngineCore" in command],
        "the vLLM engine core process",
    )
    for pid in engines:
        os.kill(pid, signal.SIGKILL)
    assert run.finish(timeout_s=600) == 0, run.output[-4000:]
    assert "the vLLM engine died (engine process" in run.output
    assert "died and was restarted (1 of --max-actor-restarts 1)" in run.output
    train = [r for r in read_metrics(run_dir_in(tmp_path) / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))


VLM_STEPS = 3


def test_the_tiny_vlm_runs_on_vllm_with_image_prompts_and_stays_on_policy(producer_python, tmp_path):
    """README's vision-language command on ``-b vllm``, a few fully on-policy steps: producers generate from the
    shapes task's pictures on the real engine, every sync (language model and vision tower) reaches it — the
    trainer's recomputed log-probs equal vLLM's behaviour log-probs at every step — and the run finishes."""
    from colossal_rl.config import EMBEDDED_SHAPES_TRAIN_DATA, EMBEDDED_VLM_DIR

    command = [
        sys.executable, "rl_example.py", "-b", "vllm", "--no-wandb", "-m", str(EMBEDDED_VLM_DIR),
        "-d", str(EMBEDDED_SHAPES_TRAIN_DATA), "-rt", "boxed", "-mnt", "12", "-nb", "0",
        "--max-steps", str(VLM_STEPS), "-ei", "0", "--timeout", "300", "-sd", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=marked_env(new_marker()), capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    train = [r for r in read_metrics(run_dir_in(tmp_path) / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, VLM_STEPS + 1))
    diffs = [r["off_policy/logprob_abs_diff"] for r in train]
    assert max(diffs) < ON_POLICY_MAX_LOGPROB_DIFF, diffs
    assert all(r["train/staleness"] == 0 for r in train)
