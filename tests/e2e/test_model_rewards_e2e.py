"""Rewards from models in whole runs (``rl_example.py`` in a subprocess, Ray on this machine):

- a judge behind an OpenAI-compatible endpoint (a stub on loopback that judges the arithmetic exactly) trains the
  embedded policy as the verifier would: ``boxed`` (weight 0, listed first) measures the lift exactly;
- GRPO on the embedded reward model alone lifts the exact accuracy by 20 points, through a restart of its reward
  actor (SIGKILLed mid-run: Ray starts it again, the producers' requests are sent again, every sample is scored);
- a reward function hanging on some responses costs those samples, not the run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_processes import actor_pids, marked_env, new_marker

from colossal_rl.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from judge_stub_server import JudgeStub, StubReply  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "Question: {prompt}\nResponse: {response}\nReference answer: {reference}\nScore the response 0 or 1."


def exact_judge(number: int, prompt: str) -> StubReply:
    """``Score: 1`` when the response's last ``\\boxed{}`` is the reference answer, else ``Score: 0``."""
    response = prompt.split("\nResponse: ", 1)[1].split("\nReference answer: ", 1)[0]
    reference = prompt.split("\nReference answer: ", 1)[1].split("\n", 1)[0].strip()
    boxed = re.findall(r"\\boxed\{([^}]*)\}", response)
    return StubReply(f"Score: {int(bool(boxed) and boxed[-1].strip() == reference)}")


def run(tmp_path: Path, *flags: str, marker: str | None = None) -> subprocess.Popen:
    command = [sys.executable, "rl_example.py", "--no-wandb", "-sd", str(tmp_path / "runs"), *flags]
    log = (tmp_path / "run.log").open("w")
    return subprocess.Popen(command, cwd=REPO, env=marked_env(marker or new_marker()), stdout=log, stderr=log)


def records_of(tmp_path: Path) -> list[dict]:
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return read_metrics(run_dir / "metrics.jsonl")


def test_a_judge_behind_an_endpoint_trains_the_policy_as_the_verifier_would(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    with JudgeStub(exact_judge) as stub:
        process = run(
            tmp_path, "--reward-mix", "boxed=0,judge=1", "--judge-template", str(template), "--judge-rule", "number",
            "--judge-model", "exact-arithmetic", "--judge-url", stub.url, "--max-steps", "20", "-ei", "20",
        )  # fmt: skip
        assert process.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
        asked = len(stub.requests)
    records = records_of(tmp_path)
    evals = [r["eval/math_accuracy"] for r in records if r["kind"] == "eval"]
    assert evals[0] == pytest.approx(0.215) and evals[-1] >= evals[0] + 0.2, evals  # the default run's 0.825
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert all(r["rollout/infra_error_fraction"] == 0 for r in rollouts)
    assert all(r["rollout/reward_judge_mean"] == pytest.approx(r["rollout/reward_boxed_mean"]) for r in rollouts)
    assert asked >= sum(r["rollout/groups"] for r in rollouts) * 8  # every sample went to the judge


HANGING_PLUGIN = '''import time
import zlib


def score(response, row):
    """Hangs on about one response in 25 (a verifier stuck on some inputs); else 1 for a boxed answer."""
    if response and zlib.crc32(response.encode()) % 25 == 0:
        time.sleep(3600)
    return 1.0 if "\\\\boxed{" in response else 0.0
'''


def test_a_reward_function_hanging_on_some_responses_costs_those_samples_not_the_run(tmp_path):
    plugin = tmp_path / "hanging_reward.py"
    plugin.write_text(HANGING_PLUGIN)
    process = run(tmp_path, "--reward-fn", f"{plugin}:score", "--reward-timeout", "1", "--max-steps", "2", "-ei", "0")
    assert process.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    text = (tmp_path / "run.log").read_text()
    assert f"reward_fn {plugin}:score gave no reward within --reward-timeout 1s" in text
    rollouts = [r for r in records_of(tmp_path) if r["kind"] == "rollout"]
    hung = [r["rollout/infra_error_fraction"] for r in rollouts]
    assert any(0 < fraction < 0.5 for fraction in hung), hung  # some samples lost, the rest scored
    assert [r["step"] for r in records_of(tmp_path) if r["kind"] == "train"] == [1, 2]


def test_grpo_on_the_tiny_reward_model_alone_lifts_exact_accuracy_through_a_reward_actor_restart(tmp_path):
    """The embedded reward model (``scripts/build_tiny_reward_model.py``: trained to prefer correct sums) trains the
    policy alone (``model=1``); ``boxed`` (weight 0, listed first) measures the answers exactly. Its reward actor is
    SIGKILLed once training has started: Ray starts it again, the producers send their requests again, every
    sample is scored (none lost, no infra_error) and the lift is the undisturbed one (the model is deterministic)."""
    from colossal_rl.config import ASSETS_DIR

    marker, log = new_marker(), tmp_path / "run.log"
    process = run(
        tmp_path, "--reward-mix", "boxed=0,model=1", "--reward-model", str(ASSETS_DIR / "tiny_reward_model"),
        "--max-steps", "20", "-ei", "20", marker=marker,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "optimizer steps:" not in log.read_text() or not actor_pids(marker, "RewardModelActor"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        first = actor_pids(marker, "RewardModelActor")
        os.kill(min(first), signal.SIGKILL)
        while not actor_pids(marker, "RewardModelActor") - first:  # Ray starts it again
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    records = records_of(tmp_path)
    evals = [r["eval/math_accuracy"] for r in records if r["kind"] == "eval"]
    assert evals[0] == pytest.approx(0.215) and evals[-1] >= evals[0] + 0.2, evals  # 0.49 when measured
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 21))
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert all(r["rollout/infra_error_fraction"] == 0 for r in rollouts)  # every sample scored once, none lost
