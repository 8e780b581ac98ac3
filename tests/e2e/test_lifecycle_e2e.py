"""Run lifecycle end to end through ``rl_example.py``: exact resume after ``kill -9``, HF export, eval and
rollout files, the profile and every plot, a producer killed mid-run restarted with its rounds regenerated exactly, killed more often
than allowed ending the run (message naming it), and a killed trainer ending it with the resume command.

Determinism makes the resume check exact: rows per round are a pure function of (seed, round,
producer), sampling is reseeded per (round, producer), trainers run fp32 on CPU with fixed thread
counts, and the checkpoint carries the rollouts generated but not yet trained. Floats are compared
with a relative tolerance of 1e-6 (observed: bit-identical). The resumed steps depend on the restored LR
scheduler and trainer RNG: the runs warm the learning rate up over more steps than they train, and the
resume runs use a copy of the embedded model with attention dropout (``dropout_model``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from png_checks import PLOT_CURVES, assert_pngs
from run_processes import actor_pids, marked_env, new_marker

from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
KILL_AFTER_CHECKPOINT = 4
WARMUP_STEPS = 8  # > STEPS: every step trains at its own learning rate

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def command(save_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(REPO / "rl_example.py"),
        "--no-wandb",
        "--max-steps",
        str(STEPS),
        "-si",
        "2",
        "--save-limit",
        "0",
        "-ei",
        "0",
        "--log-rollout-interval",
        "3",
        "--timeout",
        "120",
        "--warmup-steps",
        str(WARMUP_STEPS),
        "-kl",
        "0.01",  # a reference model whose KL term the resumed steps reproduce too (and the plots' KL curve)
        "-sd",
        str(save_dir),
        *extra,
    ]


def run_dir_in(save_dir: Path) -> Path:
    (run_dir,) = [p for p in save_dir.iterdir() if p.is_dir()]
    return run_dir


def train_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def compared(record: dict) -> dict:
    """A train record's metrics but its timings: ``time*`` and the loop's idle fractions (wall-clock shares)."""
    return {k: v for k, v in record.items() if not k.startswith("time") and not k.endswith("_idle_fraction")}


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> str:
    """The embedded model with attention dropout 0.1: trainer-side random draws a resume must reproduce."""
    model_dir = tmp_path_factory.mktemp("dropout_model") / "tiny_qwen2"
    shutil.copytree(REPO / "colossal_rl" / "assets" / "tiny_qwen2", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.1}))
    return str(model_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, dropout_model) -> Path:
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    # Profiling only records timings: the resumed run (without it) must still match this one exactly.
    done = subprocess.run(
        command(save_dir, "--enable_profiling", "-m", dropout_model),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir_in(save_dir)


def assert_trained_alike(expected: dict[int, dict], got: dict[int, dict], steps) -> None:
    """Every metric of every step equal (floats to 1e-6 relative), timings aside."""
    for step in steps:
        want, have = compared(expected[step]), compared(got[step])
        assert have.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                assert have[key] == pytest.approx(value, rel=1e-6, abs=1e-9), f"step {step}: {key}"
            else:  # counts, data indices, non-finite values (stored as strings)
                assert have[key] == value, f"step {step}: {key}"


class Run:
    """``rl_example.py`` in the background, its stderr collected, its processes marked (``run_processes``)."""

    def __init__(self, argv: list[str]):
        self.marker = new_marker()
        self.process = subprocess.Popen(
            argv, cwd=REPO, env=marked_env(self.marker), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, condition, what: str, timeout_s: float = 300):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            assert self.process.poll() is None, f"the run ended before {what}: {self.output[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"not within {timeout_s}s: {what}")

    def finish(self, timeout_s: float) -> int:
        try:  # a hang guard, not a speed target
            returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the run hung: {self.output[-3000:]}") from None
        self.reader.join(timeout=10)
        return returncode

    def actor_pids(self, actor: str = "ProducerActor") -> set[int]:
        """This run's worker processes of ``actor`` (never another run's)."""
        return actor_pids(self.marker, actor)

    def kill_a_producer_while_training(self, known: set[int] = frozenset()) -> int:
        """``kill -9`` a producer of this run that is not in ``known`` once training has started; returns its pid."""
        self.wait_for(lambda: "optimizer steps:" in self.output, "training started")
        pid = self.wait_for(lambda: min(self.actor_pids() - known, default=None), "a producer process")
        os.kill(pid, signal.SIGKILL)
        return pid


def test_a_producer_killed_again_right_after_its_restart_is_restarted_again(uninterrupted, dropout_model, tmp_path):
    """Elastic producers: a producer killed while training is restarted, gets the last synced weights back and
    regenerates its lost rounds; a second kill lands as the restarted producer is being given its weights back or
    as the next sync's group forms: with restarts left it is restarted again, given the weights again, its lost
    rounds made again before that sync, and the trainer waiting in the formation is freed at once (not after
    ``--timeout``). Every step trains the same samples to the same metrics as the undisturbed run."""
    save_dir = tmp_path / "twice"
    run = Run(command(save_dir, "-m", dropout_model, "--max-actor-restarts", "3"))
    first = run.kill_a_producer_while_training()
    run.wait_for(lambda: "died and was restarted (1 of --max-actor-restarts 3)" in run.output, "the first restart")
    second = run.wait_for(lambda: min(run.actor_pids() - {first}, default=None), "the restarted producer")
    os.kill(second, signal.SIGKILL)
    assert run.finish(timeout_s=500) == 0, run.output[-3000:]
    assert "died and was restarted (2 of --max-actor-restarts 3)" in run.output
    faults = [r["faults/producer_restarts"] for r in read_metrics(run_dir_in(save_dir) / "metrics.jsonl")
              if r["kind"] == "faults"]  # fmt: skip
    assert faults in ([1, 2], [2]), faults  # the second death may be repaired with the first
    got, expected = train_records(run_dir_in(save_dir)), train_records(uninterrupted)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert_trained_alike(expected, got, range(1, STEPS + 1))


def kill_driver_after_checkpoint(save_dir: Path, step: int, model: str) -> Path:
    """Start a run, ``kill -9`` its driver as soon as the checkpoint of ``step`` is committed."""
    driver = subprocess.Popen(
        command(save_dir, "-m", model), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:
            found = list(save_dir.glob(f"*/checkpoints/step_{step:06d}/state.json"))
            if found:
                os.kill(driver.pid, signal.SIGKILL)
                driver.wait(timeout=30)
                return found[0].parent
            assert driver.poll() is None, "the run ended before its checkpoint appeared"
            time.sleep(0.1)
        raise AssertionError(f"no checkpoint of step {step} within 400s")
    finally:
        if driver.poll() is None:
            driver.kill()


def test_resume_after_kill_9_matches_the_uninterrupted_run(uninterrupted, dropout_model, tmp_path):
    checkpoint = kill_driver_after_checkpoint(tmp_path / "killed", KILL_AFTER_CHECKPOINT, dropout_model)
    killed_run = checkpoint.parents[1]
    resumed_dir = tmp_path / "resumed"
    done = subprocess.run(
        command(resumed_dir, "-cp", str(checkpoint), "-m", dropout_model),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr

    assert_resumed_alike(
        train_records(uninterrupted), train_records(killed_run), train_records(run_dir_in(resumed_dir)),
        checkpoint_step=KILL_AFTER_CHECKPOINT, steps=STEPS,
    )  # fmt: skip


def assert_resumed_alike(expected: dict, before_kill: dict, resumed: dict, *, checkpoint_step: int, steps: int) -> None:
    """A run killed after its ``checkpoint_step`` checkpoint and resumed from it trained steps 1..``steps`` alike
    to the uninterrupted run (``expected``), and every prompt exactly once across the killed and resumed runs."""
    assert sorted(expected) == list(range(1, steps + 1))
    assert sorted(resumed) == list(range(checkpoint_step + 1, steps + 1)), "resume must start after the checkpoint"
    assert_trained_alike(expected, resumed, range(checkpoint_step + 1, steps + 1))
    seen = [i for s in range(1, checkpoint_step + 1) for i in before_kill[s]["train/data_indices"]]
    seen += [i for s in range(checkpoint_step + 1, steps + 1) for i in resumed[s]["train/data_indices"]]
    assert sorted(seen) == sorted(i for s in expected.values() for i in s["train/data_indices"])
    assert len(seen) == len(set(seen)), "a prompt was trained twice across the killed and the resumed run"


def test_checkpoints_are_committed_whole_and_export_loads_and_generates(uninterrupted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoints = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000004", "step_000006"], "no temporary dirs left, all kept"
    last = uninterrupted / "checkpoints" / "step_000006"
    state = json.loads((last / "state.json").read_text())
    # the round schedule's snapshot: 6 rounds of 1 step trained (version 6), every chunk ordered since delivered
    assert (state["step"], state["schedule"]["rounds_trained"], state["policy_version"]) == (6, 6, 6)

    export = last / "hf"
    assert (export / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(REPO / "colossal_rl" / "assets" / "tiny_qwen2")
    changed = [n for n, p in model.state_dict().items() if not p.equal(base.state_dict()[n])]
    assert changed, "the export holds the base weights, not the trained ones"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34"}], add_generation_prompt=True, return_tensors="pt"
    )
    output = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert output.shape[1] > prompt.shape[1]
    # The run's final model is that last checkpoint's export, hard-linked rather than gathered and written again.
    final = uninterrupted / "final" / "model.safetensors"
    assert final.stat().st_ino == (export / "model.safetensors").stat().st_ino


def test_eval_before_training_is_logged_and_its_generations_written(uninterrupted):
    evals = [r for r in read_metrics(uninterrupted / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, STEPS]
    records = [json.loads(line) for line in (uninterrupted / "eval" / "math_step_0.jsonl").read_text().splitlines()]
    assert len(records) == 200  # the embedded eval set
    assert evals[0]["eval/math_accuracy"] == pytest.approx(sum(r["correct"] for r in records) / len(records))
    assert 0.05 <= evals[0]["eval/math_accuracy"] <= 0.5  # the embedded model starts partially competent
    rollouts = (uninterrupted / "rollouts" / "rollouts_step_3.jsonl").read_text().splitlines()
    sample = json.loads(rollouts[0])
    assert {"prompt", "response", "reward", "data_index"} <= sample.keys()


def test_profile_has_every_actors_phases_and_renders(uninterrupted):
    from PIL import Image

    from colossal_rl.profiling import busy_fractions, read_spans

    spans = read_spans(uninterrupted)
    assert set(spans) == {"producer 0", "trainer 0"}
    assert {"generate", "reward", "put", "sync", "eval"} <= {s.phase for s in spans["producer 0"]}
    # (no trainer "wait" phase: trainers no longer wait on the buffer for a round, the driver orders it once in)
    assert {"fetch", "forward_backward", "optimizer_step", "sync", "checkpoint"} <= {
        s.phase for s in spans["trainer 0"]
    }
    fractions = busy_fractions(spans)
    assert all(0.0 <= share <= 1.0 for shares in fractions.values() for share in shares.values())
    done = subprocess.run(
        [sys.executable, "-m", "colossal_rl.profiling", str(uninterrupted)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "producer 0" in done.stderr and "generate" in done.stderr
    with Image.open(uninterrupted / "plots" / "profile_timeline.png") as image:
        image.verify()


def test_plots_of_the_uninterrupted_profiled_run(uninterrupted, tmp_path):
    """``python -m colossal_rl.plot`` on a real profiled run (Ray, two actors): every curve and the timeline."""
    from colossal_rl.plot import series

    run_dir = tmp_path / uninterrupted.name
    shutil.copytree(uninterrupted, run_dir)  # the plots are written into the run: leave the shared run as it was
    shutil.rmtree(run_dir / "plots", ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "colossal_rl.profiling", str(run_dir)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "colossal_rl.plot", str(run_dir)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = read_metrics(run_dir / "metrics.jsonl")
    assert series(records, "train/kl")[0], "the run logged no KL (-kl 0.01)"
    entropy = {"entropy"} if series(records, "train/entropy")[0] else set()
    assert_pngs(run_dir / "plots", PLOT_CURVES | entropy | {"profile_timeline"})


def test_a_producer_killed_more_often_than_allowed_ends_the_run_naming_it(tmp_path):
    run = Run(command(tmp_path, "--max-steps", "40", "--timeout", "60", "--max-actor-restarts", "1"))
    first = run.kill_a_producer_while_training()
    run.wait_for(lambda: "died and was restarted (1 of --max-actor-restarts 1)" in run.output, "the restart")
    run.kill_a_producer_while_training({first})
    assert run.finish(timeout_s=300) == 2
    assert re.search(r"ERROR .*producer 0 \(\w+\) (failed|died).*--max-actor-restarts 1 used up", run.output), (
        run.output[-3000:]
    )


def test_a_killed_trainer_ends_the_run_with_the_command_that_resumes_it(tmp_path):
    """In shm weight-sync mode, so the killed sender's /dev/shm region (never closed) must be removed by the
    driver's shutdown too."""
    regions_before = set(Path("/dev/shm").glob("colossal_rl-*"))
    run = Run(command(tmp_path, "--max-steps", "40", "--timeout", "60", "--weight-sync-mode", "shm"))
    checkpoint = run.wait_for(
        lambda: min(tmp_path.glob("*/checkpoints/step_000002/state.json"), default=None), "a checkpoint"
    )
    os.kill(min(run.actor_pids("TrainerActor")), signal.SIGKILL)
    assert run.finish(timeout_s=300) == 2
    run_dir = checkpoint.parents[2]
    expected = (
        f"resume with: python rl_example.py --config {run_dir / 'config.yaml'} -cp {run_dir / 'checkpoints'}/step_"
    )
    assert re.search(r"ERROR .*trainer 0 \(\w+\) died", run.output) and expected in run.output, run.output[-3000:]
    assert "trainer 0" in (run_dir / "FAILED").read_text(), "a failed run says so in its directory"
    assert "removed the shared-memory weight-sync region" in run.output, run.output[-3000:]
    assert set(Path("/dev/shm").glob("colossal_rl-*")) <= regions_before, "the killed sender's region is left"
