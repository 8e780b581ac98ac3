"""``rl_example.py -b vllm`` end to end on a two-node ``ray start`` cluster and with the tiny VLM.

- A Qwen3 policy (tiny, random, head_dim 32) on a two-node ``ray start`` cluster made on this machine
  (``--master_address``): a producer on each node, started with the producers' interpreter by that node's raylet,
  the run on policy at every step; a node where that interpreter does not run is named in one line before any actor
  starts.
- The embedded tiny VLM on the shapes task (image prompts through the engine), fully on policy (``-nb 0``): at every
  step the trainer's recomputed log-probs equal vLLM's behaviour log-probs (every sync, vision tower included,
  reached the engine), also after its producer was killed and restarted by Ray.
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
from tiny_models import build_qwen3
from vllm_runs import (
    DIGIT_SHARE_REWARD,
    MIN_MOVEMENT_PER_STEP,
    ON_POLICY_MAX_LOGPROB_DIFF,
    REPO,
    Run,
    assert_on_policy_at_every_step,
    logprob_movement,
    on_policy_command,
    run_dir_in,
)

from colossal_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.dist]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return {"qwen3": build_qwen3(tmp_path_factory.mktemp("tiny_models") / "qwen3")}


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
    """The vision guide's command (docs/guides/vision.md) on ``-b vllm``, fully on policy (``-nb 0``), its producer killed by SIGKILL
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
