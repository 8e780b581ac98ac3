"""``rl_example.py -b vllm`` end to end: producers on the real vLLM engine in their own environment (torch 2.13,
transformers 5), trainers on ColossalAI's stack (torch 2.5.1), weights crossing the two over the gloo weight sync.

- The default run with ``-b vllm`` (its first ``DEFAULT_RUN_STEPS`` steps) learns like the default run (eval lift
  >= ``DEFAULT_RUN_MIN_GAIN``), its engine killed once mid-run (the producer is restarted with a new engine).
- LoRA (``--lora-rank``): only adapters cross, the producer merges them into the checkpoint's base weights; on
  policy, every step's log-probs equal vLLM's and the policy the engine serves moves (eval changes).
- A head_dim-16 model is refused in one line; no producer environment is one clear line and no hang.

The two-node cluster and the tiny VLM are in ``test_vllm_e2e_cluster_vision.py`` (a file per xdist worker).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from run_processes import marked_env, new_marker, processes_of_run
from tiny_models import build_head_dim_16
from vllm_runs import (
    DEFAULT_RUN_MIN_GAIN,
    DEFAULT_RUN_STEPS,
    LORA,
    MIN_MOVEMENT_PER_STEP,
    REPO,
    Run,
    assert_on_policy_at_every_step,
    logprob_movement,
    on_policy_command,
    run_dir_in,
)

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.dist]


def test_the_default_run_on_vllm_learns_also_when_its_engine_dies(producer_python, tmp_path):
    """The default run with ``-b vllm``, cut to its first eval interval, learns like the default run, with its engine
    killed once mid-run.

    The engine core is a child process of the producer: killed, the producer's watchdog says so in one line and ends
    the producer, which Ray restarts with a new engine and the current weights (``--max-actor-restarts`` default 2);
    the run trains every step once and still lifts eval accuracy by ``DEFAULT_RUN_MIN_GAIN``."""
    run = Run([sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "--max-steps", str(DEFAULT_RUN_STEPS),
               "-sd", str(tmp_path)])  # fmt: skip
    run.wait_for(lambda: "optimizer steps:" in run.output, "training started", timeout_s=600)
    engines = run.wait_for(
        lambda: [pid for pid, command in processes_of_run(run.marker).items() if "EngineCore" in command],
        "the vLLM engine core process",
    )
    for pid in engines:
        os.kill(pid, signal.SIGKILL)
    assert run.finish(timeout_s=1500) == 0, run.output[-4000:]
    assert "the vLLM engine died (engine process" in run.output
    assert "died and was restarted (1 of --max-actor-restarts 2)" in run.output
    records = read_metrics(run_dir_in(tmp_path) / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    evals = [r for r in records if r["kind"] == "eval"]
    start, end = evals[0]["eval/math_accuracy"], evals[-1]["eval/math_accuracy"]
    assert end >= start + DEFAULT_RUN_MIN_GAIN, f"eval accuracy {start} -> {end}"


def test_a_missing_producer_environment_is_one_clear_line(tmp_path):
    missing = tmp_path / "no-such-env" / "bin" / "python"
    env = marked_env(new_marker()) | {"COLOSSAL_RL_PRODUCER_PYTHON": str(missing)}
    done = subprocess.run([sys.executable, "rl_example.py", "-b", "vllm", "--no-wandb", "-sd", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(missing) in errors[0], done.stderr[-2000:]


def test_lora_every_adapter_sync_reaches_the_engine(producer_python, tmp_path):
    """The sync carries adapters only; the producer merges them into the base weights it reads from the checkpoint
    and loads the merged layers (a partial load: norms, embeddings and biases keep their values)."""
    steps = 3
    done = subprocess.run(on_policy_command(tmp_path, steps, *LORA), cwd=REPO, env=marked_env(new_marker()),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "LoRA: the weight sync carries" in done.stderr
    run_dir = run_dir_in(tmp_path)
    records = assert_on_policy_at_every_step(run_dir, steps)
    assert logprob_movement(EMBEDDED_MODEL_DIR, run_dir / "final") > steps * MIN_MOVEMENT_PER_STEP
    evals = [r["eval/math_accuracy"] for r in records if r["kind"] == "eval"]
    assert evals[0] != evals[-1], evals  # vLLM's own greedy answers changed: the merged weights are being served


def test_a_model_vllms_cpu_attention_refuses_ends_the_run_in_one_line(producer_python, tmp_path):
    command = on_policy_command(tmp_path / "run", 2, "-m", str(build_head_dim_16(tmp_path / "head_dim_16")))
    done = subprocess.run(command, cwd=REPO, env=marked_env(new_marker()), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr[-4000:]
    assert "the vLLM engine cannot serve" in errors[0] and "this model has 16" in errors[0]
    assert "use -b transformers" in errors[0]
