"""``rl_example.py -b vllm`` end to end: producers on the real vLLM engine in their own environment (torch 2.13,
transformers 5), trainers on ColossalAI's stack (torch 2.5.1), weights crossing the two over the gloo weight sync.

- The default run with ``-b vllm`` learns like the default run (eval lift >= ``DEFAULT_RUN_MIN_GAIN``), its engine
  killed once mid-run (the producer is restarted with a new engine).
- LoRA (``--lora-rank``): only adapters cross, the producer merges them into the checkpoint's base weights; on
  policy, every step's log-probs equal vLLM's and the policy the engine serves moves (eval changes).
- A Qwen3 policy (tiny, random, head_dim 32) on a two-node ``ray start`` cluster made on this machine
  (``--master_address``): a producer on each node, started with the producers' interpreter by that node's raylet,
  the run on policy at every step; a node where that interpreter does not run is named in one line before any actor
  starts; a head_dim-16 model is refused in one line.
- The embedded tiny VLM on the shapes task (image prompts through the engine), fully on policy (``-nb 0``): at every
  step the trainer's recomputed log-probs equal vLLM's behaviour log-probs (every sync, vision tower included,
  reached the engine), also after its producer was killed and restarted by Ray.
- Bad input: no producer environment, one clear line and no hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from ray_start_cluster import STOP_GRACE_S, RayStartCluster, free_port
from run_processes import marked_env, new_marker, processes_of_run
from tiny_models import build_head_dim_16, build_qwen3

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN_MIN_GAIN = 0.25
ON_POLICY_MAX_LOGPROB_DIFF = 1e-3
"""Mean |log p_trainer - log p_vLLM| over a step's tokens with both at the same weights (fp32); a missed sync
shows up as ~1e-2 or more after one optimizer step."""

MIN_MOVEMENT_PER_STEP = 10 * ON_POLICY_MAX_LOGPROB_DIFF
"""Mean |log p| change per optimizer step of the trained policy (export against the initial model): a sync that
missed the engine would leave a log-prob diff of about this size, ten times what ``ON_POLICY_MAX_LOGPROB_DIFF``
lets through."""
LORA = ("--lora-rank", "4", "--lora-alpha", "8", "-lr", "2e-3")
"""LoRA at a learning rate LoRA is trained at (10x the full-weight default): the adapters move the policy by more
than ``MIN_MOVEMENT_PER_STEP`` a step."""
DIGIT_SHARE_REWARD = """
def digit_share(response, row):
    return sum(character.isdigit() for character in response) / max(1, len(response))
"""
"""A reward a random model's samples differ in (the math reward gives them all 0: no advantage, no update)."""

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.dist]

sys.path.insert(0, str(REPO / "tests" / "e2e"))
from test_lifecycle_e2e import Run  # noqa: E402  (the background run with its marked processes)


def run_dir_in(save_dir: Path) -> Path:
    (run_dir,) = [p for p in save_dir.iterdir() if p.is_dir()]
    return run_dir


def on_policy_command(save_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "-nb", "0", "--max-steps", str(steps),
        "-ei", "0", "--timeout", "300", "-sd", str(save_dir), *extra,
    ]  # fmt: skip


def assert_on_policy_at_every_step(run_dir: Path, steps: int) -> list[dict]:
    """Every step trained on rollouts of the current weights, with vLLM's log-probs equal to the trainer's."""
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    diffs = [r["off_policy/logprob_abs_diff"] for r in train]
    assert max(diffs) < ON_POLICY_MAX_LOGPROB_DIFF, diffs
    assert all(r["train/staleness"] == 0 for r in train)
    return records


def logprob_movement(initial: Path, trained: Path) -> float:
    """Mean |log p_trained - log p_initial| over the answer tokens of a few prompts (the trainer's fp32 forward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(initial)
    rows = []
    for question, answer in (("12+34=", "46"), ("7+8=", "15"), ("55+21=", "76")):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        rows.append((prompt, tokenizer(f"The answer is \\boxed{{{answer}}}", add_special_tokens=False).input_ids))

    def answer_logprobs(directory: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
        found = []
        with torch.no_grad():
            for prompt, answer in rows:
                logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
                found.append(logits.log_softmax(-1).gather(-1, torch.tensor(answer)[:, None]).squeeze(-1))
        return torch.cat(found)

    return float((answer_logprobs(trained) - answer_logprobs(initial)).abs().mean())


def test_the_default_run_on_vllm_learns_also_when_its_engine_dies(producer_python, tmp_path):
    """The default run with ``-b vllm`` learns like the default run, with its engine killed once mid-run.

    The engine core is a child process of the producer: killed, the producer's watchdog says so in one line and ends
    the producer, which Ray restarts with a new engine and the current weights (``--max-actor-restarts`` default 2);
    the run trains every step once and still lifts eval accuracy by ``DEFAULT_RUN_MIN_GAIN``."""
    run = Run([sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "-sd", str(tmp_path)])
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


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {"qwen3": build_qwen3(root / "qwen3"), "head_dim_16": build_head_dim_16(root / "head_dim_16")}


def test_a_model_vllms_cpu_attention_refuses_ends_the_run_in_one_line(producer_python, tiny_models, tmp_path):
    command = on_policy_command(tmp_path, 2, "-m", str(tiny_models["head_dim_16"]))
    done = subprocess.run(command, cwd=REPO, env=marked_env(new_marker()), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr[-4000:]
    assert "the vLLM engine cannot serve" in errors[0] and "this model has 16" in errors[0]
    assert "use -b transformers" in errors[0]


def runs_from(pid: int, environment: Path) -> bool:
    """Whether process ``pid`` has files of ``environment`` mapped (its interpreter is a symlink to the system's
    python in every virtualenv, so the executable cannot tell)."""
    return any(region.path.startswith(f"{environment}/") for region in psutil.Process(pid).memory_maps())


NO_PRODUCER_ENV_HERE = "COLOSSAL_RL_TEST_NO_PRODUCER_ENV"
"""Set on the second node only: a wrapper interpreter fails where it is set, as a missing environment would."""


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head with 1 CPU and a second node with 2, both ``ray start``-ed here; always stopped, every wait bounded."""
    cluster = RayStartCluster()
    try:
        cluster.add_node("head_node", num_cpus=1)
        cluster.add_node("second_node", num_cpus=2, env={NO_PRODUCER_ENV_HERE: "1"})
        yield cluster
    finally:
        killed = cluster.stop()
        assert not killed, f"still running {STOP_GRACE_S}s after ray start was stopped: {killed}"


def test_a_node_the_producers_interpreter_does_not_run_on_is_named_before_actors_start(
    producer_python, two_node_cluster, tmp_path
):
    """The driver resolves the producers' interpreter on its own machine; on a cluster it must exist at that path on
    every producer node. Simulated for the second node: an interpreter that fails where ``NO_PRODUCER_ENV_HERE`` is
    set. The run ends in one line naming that node, instead of Ray retrying the producer until ``--timeout``."""
    wrapper = tmp_path / "bin" / "python"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f'#!/bin/sh\nif [ -n "${NO_PRODUCER_ENV_HERE}" ]; then echo "no producer environment here" >&2; exit 127; fi\n'
        f'exec {producer_python} "$@"\n'
    )
    wrapper.chmod(0o755)
    command = on_policy_command(tmp_path / "run", 2, "-i", "2", "--master_address", two_node_cluster.address,
                                "--master_port", str(free_port()))  # fmt: skip
    env = marked_env(new_marker()) | {"COLOSSAL_RL_PRODUCER_PYTHON": str(wrapper)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert f"the producers' interpreter {wrapper} does not run on " in errors[0]
    assert errors[0].count("(node ") == 1 and "exit status 127: no producer environment here" in errors[0]
    assert "ProducerActor" not in done.stderr  # refused before any producer was started


def actors_by_node(cluster: RayStartCluster) -> dict[int, tuple[str, str | None]]:
    """pid -> (Ray actor class, node) of the cluster's producer and trainer processes."""
    found = {}
    for pid, command in processes_of_run(cluster.marker).items():
        for actor in ("ProducerActor", "TrainerActor"):
            if command.startswith(f"ray::{actor}"):
                found[pid] = (actor, cluster.node_of(pid))
    return found


def test_a_qwen3_policy_on_vllm_producers_of_a_two_node_ray_start_cluster(
    producer_python, two_node_cluster, tiny_models, tmp_path
):
    """A tiny random Qwen3 (head_dim 32) trained with a ``--reward-fn`` on a two-node ``ray start`` cluster.

    Placement puts producer 0 on the head (its one CPU), producer 1 and the trainer on the second node; each node's
    raylet starts its producer with the interpreter the driver resolved (``producer_env``: on real nodes the same
    path must exist on each, which one machine cannot show). Weights reach both engines at every step (on policy),
    the trained policy moved, and vLLM's greedy answers gained digits (seen: "" -> "999...", 0.0 -> 1.0)."""
    cluster, steps = two_node_cluster, 4
    producer_env = Path(producer_python).parents[1].resolve()
    reward = tmp_path / "digit_reward.py"
    reward.write_text(DIGIT_SHARE_REWARD)
    run = Run(on_policy_command(tmp_path / "run", steps, "-i", "2", "--master_address", cluster.address,
                                "--master_port", str(free_port()), "-m", str(tiny_models["qwen3"]),
                                "--reward-fn", f"{reward}:digit_share"))  # fmt: skip
    try:
        run.wait_for(lambda: "optimizer steps:" in run.output, "training started", timeout_s=600)
        actors = actors_by_node(cluster)
        nodes = sorted(actors.values())
        expected = [("ProducerActor", "head_node"), ("ProducerActor", "second_node"), ("TrainerActor", "second_node")]
        assert nodes == expected, actors
        for pid, (actor, _) in actors.items():  # vLLM and torch 2.13 loaded from the producers' environment
            assert runs_from(pid, producer_env) == (actor == "ProducerActor"), actors
        assert run.finish(timeout_s=900) == 0, run.output[-4000:]
    finally:
        if run.process.poll() is None:  # a failed check above: end the driver before the cluster goes
            run.process.kill()
    assert f"joining the Ray cluster at {cluster.address}" in run.output
    run_dir = run_dir_in(tmp_path / "run")
    records = assert_on_policy_at_every_step(run_dir, steps)
    assert logprob_movement(tiny_models["qwen3"], run_dir / "final") > steps * MIN_MOVEMENT_PER_STEP
    evals = [r["eval/math_accuracy"] for r in records if r["kind"] == "eval"]  # scored by --reward-fn
    assert evals[-1] > evals[0], evals  # both engines served the moving policy to the end


VLM_STEPS = 6


def test_the_tiny_vlm_on_vllm_stays_on_policy_at_every_step_also_after_a_producer_restart(producer_python, tmp_path):
    """README's vision-language command on ``-b vllm``, fully on policy (``-nb 0``), its producer killed by SIGKILL
    once training has started: producers generate from the shapes task's pictures on the real engine; Ray restarts
    the producer, which gets the last synced weights (language model and vision tower) from the object store and the
    rounds it lost; every sync before and after reaches the engine — the trainer's recomputed log-probs equal vLLM's
    behaviour log-probs at every step — and the run trains each step once."""
    from colossal_rl.config import EMBEDDED_SHAPES_TRAIN_DATA, EMBEDDED_VLM_DIR

    run = Run([
        sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "-m", str(EMBEDDED_VLM_DIR),
        "-d", str(EMBEDDED_SHAPES_TRAIN_DATA), "-rt", "boxed", "-mnt", "12", "-nb", "0",
        "--max-steps", str(VLM_STEPS), "-ei", "0", "--max-actor-restarts", "1", "--timeout", "300",
        "-sd", str(tmp_path),
    ])  # fmt: skip
    run.wait_for(lambda: "optimizer steps:" in run.output, "training started", timeout_s=900)
    pid = run.wait_for(lambda: min(run.actor_pids(), default=None), "a producer process")
    os.kill(pid, signal.SIGKILL)
    assert run.finish(timeout_s=1500) == 0, run.output[-4000:]
    assert "died and was restarted (1 of --max-actor-restarts 1)" in run.output
    train = [r for r in read_metrics(run_dir_in(tmp_path) / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, VLM_STEPS + 1))
    diffs = [r["off_policy/logprob_abs_diff"] for r in train]
    assert max(diffs) < ON_POLICY_MAX_LOGPROB_DIFF, diffs
    assert all(r["train/staleness"] == 0 for r in train)
