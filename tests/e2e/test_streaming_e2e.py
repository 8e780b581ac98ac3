"""``rl_example.py --schedule stream`` end to end on the embedded model (issue 35): every requested optimizer step
is trained, no group staler than ``--max-staleness``, no prompt trained twice in the epoch, evals where ``-ei``
puts them; with DAPO's dynamic sampling the filtered groups are made up by further chunks; a resumed run trains
no row the interrupted one trained; a producer killed mid-run is restarted and its lost chunks' rows are
generated again. The three text runs train one sequence layout each (packed, padded, the default shared_prompt);
the embedded tiny VLM trains LoRA adapters, synced alone, and its producer samples from the trained policy."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_processes import actor_pids, marked_env, new_marker

from colossal_rl.metrics import read_metrics
from colossal_rl.run_checkpoints import on_disk as ckpt

REPO = Path(__file__).resolve().parents[2]
SMALL = ["-t", "2", "-i", "2", "-g", "4", "-ibs", "8", "-imbs", "4", "-tbs", "4", "-tMbs", "4", "-tmbs", "16"]
STREAM = ["--schedule", "stream", "--no-wandb", "--timeout", "120"]
PADDED = ("--sequence-layout", "padded")
ADAPTER_PERCENT = 5.0
"""The tiny VLM's LoRA sync (rank 4, the language model's linear layers) against the whole model: measured 3.80 %."""
SAME_POLICY_LOGPROB_DIFF = 1e-4
"""Mean |trainer - producer| log-prob of staleness-0 groups: measured <= 1.2e-7 with the adapters synced, 3.0e-3 and
4.7e-3 at steps 2 and 3 when the producer drops them (keeps the base weights)."""

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run_stream(tmp_path: Path, *flags: str) -> tuple[str, list[dict]]:
    command = [sys.executable, "rl_example.py", *SMALL, *STREAM, "-sd", str(tmp_path), *flags]
    result = subprocess.run(
        command, cwd=REPO, env=marked_env(new_marker()), capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "colossal_rl.driver.schedule_loop INFO stream schedule:" in output  # the streaming loop ran, not the rounds
    (run_dir,) = list(tmp_path.iterdir())
    return output, read_metrics(run_dir / "metrics.jsonl")


def assert_streamed(records: list[dict], *, steps: int, max_staleness: int, groups_per_step: int = 2 * 4) -> list[dict]:
    """``groups_per_step``: dp 2 x -tbs 4 groups unless the run says otherwise."""
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for record in train:
        assert record["schedule/step_staleness_max"] <= max_staleness, record
        assert record["train/staleness"] <= max_staleness, record
        assert len(record["train/data_indices"]) == groups_per_step
        assert math.isfinite(record["train/loss"]), record
    trained = [index for record in train for index in record["train/data_indices"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice in the epoch"
    return train


def assert_layout(output: str, train: list[dict], layout: str) -> None:
    """The trainers' forwards ran ``layout`` (``--sequence-layout``; the default resolves to shared_prompt on CPU):
    the trainer says so, and the positions it computed per real token agree (below 1 only when each group's
    prompt is computed once)."""
    assert f"training forward: {layout} sequence layout" in output
    per_real_token = [record["train/computed_per_real_token"] for record in train]
    assert all((value < 1) == (layout == "shared_prompt") for value in per_real_token), per_real_token


def test_stream_run_with_dynamic_sampling_and_sparser_syncs_still_trains_the_requested_steps(tmp_path):
    """With continuous batching too: producers run concurrent one-prompt chunks on one shared engine; with partial
    rollouts, whose per-token versions reach the trainers (a sync lands mid-response only when rows happen to be
    running then: ``test_producer_chunk.py`` makes it happen)."""
    output, records = run_stream(
        tmp_path, "-a", "DAPO", "-mnt", "16", "--max-steps", "4", "-ei", "2", "--max-staleness", "2",
        "--sync-every-steps", "2", "--continuous-batching", "--partial-rollouts", "--sequence-layout", "packed",
    )  # fmt: skip
    train = assert_streamed(records, steps=4, max_staleness=2)
    assert_layout(output, train, "packed")
    assert [r["step"] for r in records if r["kind"] == "sync"] == [2, 4]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    filtered = sum(r["rollout/groups_filtered"] for r in rollouts)
    assert train[-1]["schedule/groups_filtered"] == filtered
    assert filtered > 0, "nothing was filtered: the test does not show the made-up groups"
    assert {len(r["train/data_indices"]) for r in train} == {8}
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2, 4]
    assert max(r["rollout/policy_version"] for r in rollouts) >= 2  # chunks after the sync started with it
    assert all(0 <= r["train/multi_version_fraction"] <= 1 for r in train)  # token versions reached the trainers


def test_a_stream_run_stays_within_the_staleness_bound_and_resumes_training_no_row_twice(tmp_path):
    """A 4-step run (eval every 2 steps, a checkpoint at step 2, chunks in flight and groups waiting then) trains
    every step within the staleness bound, syncs after every step and ran ahead; resumed from its step-2
    checkpoint in a new run, it trains steps 3 and 4, and the two runs' steps 1-2 and 3-4 train no row twice."""
    output, first = run_stream(tmp_path / "first", "--max-steps", "4", "-ei", "2", "-si", "2", *PADDED)
    (run_dir,) = list((tmp_path / "first").iterdir())
    assert (run_dir / "startup.json").is_file()
    assert [r["time/first_rollout_s"] > 0 for r in first if r["kind"] == "startup"] == [True]
    train = assert_streamed(first, steps=4, max_staleness=1)
    assert_layout(output, train, "padded")
    assert any(record["schedule/step_staleness_max"] == 1 for record in train)  # it did run ahead
    assert [r["step"] for r in first if r["kind"] == "eval"] == [0, 2, 4]
    assert [r["step"] for r in first if r["kind"] == "sync"] == [1, 2, 3, 4]

    checkpoint = run_dir / "checkpoints" / "step_000002"
    snapshot = json.loads((checkpoint / "state.json").read_text())["schedule"]
    assert snapshot["steps_done"] == 2
    assert snapshot["in_flight"] or snapshot["waiting"], "nothing was in flight at the checkpoint: a weak test"
    usable = {group[0] for group in snapshot["waiting"] if 2 - group[3] <= 1}  # chunk ids of groups S=1 can train
    assert set(ckpt.load_chunks(checkpoint)) == usable  # their rollouts are saved, and nothing else
    output, resumed = run_stream(tmp_path / "resumed", "--max-steps", "4", "-ei", "0", "-cp", str(checkpoint), *PADDED)
    before = [r for r in first if r["kind"] == "train" and r["step"] <= 2]
    after = [r for r in resumed if r["kind"] == "train"]
    assert [r["step"] for r in after] == [3, 4]
    rows = [index for record in before + after for index in record["train/data_indices"]]
    assert len(rows) == 4 * 8 and len(set(rows)) == len(rows), "a row was trained twice in the epoch"
    assert all(record["schedule/step_staleness_max"] <= 1 for record in after)
    assert_layout(output, after, "padded")


def test_a_producer_killed_mid_run_is_restarted_and_its_rows_generated_again(tmp_path):
    marker, log = new_marker(), tmp_path / "run.log"
    command = [sys.executable, "rl_example.py", *SMALL, *STREAM, "-sd", str(tmp_path / "run"), "--max-steps", "8"]
    with log.open("w") as output:
        run = subprocess.Popen(command, cwd=REPO, env=marked_env(marker), stdout=output, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while "optimizer steps:" not in log.read_text() or not actor_pids(marker, "ProducerActor"):
                assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            os.kill(min(actor_pids(marker, "ProducerActor")), signal.SIGKILL)
            assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
    text = log.read_text()
    assert "died and was restarted (1 of --max-actor-restarts 2)" in text
    (run_dir,) = list((tmp_path / "run").iterdir())
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["faults/producer_restarts"] for r in records if r["kind"] == "faults"] == [1]
    train = assert_streamed(records, steps=8, max_staleness=1)
    assert_layout(text, train, "shared_prompt")
    assert "lost with its producer: its rows are handed out again" in text
    assert train[-1]["schedule/groups_requeued"] > 0


def test_a_stream_run_of_the_tiny_vlm_with_lora_syncs_only_adapters_and_samples_from_the_trained_policy(tmp_path):
    """The embedded tiny VLM (the vision guide's command, docs/guides/vision.md) with LoRA, one producer and one trainer, at staleness 0: each
    step's groups were generated with the weights the trainer held, so the producer's behaviour log-probs equal the
    trainer's own (``off_policy/logprob_abs_diff``) only if every sync's adapters reached it and were merged in."""
    from safetensors.torch import load_file

    from colossal_rl.config import EMBEDDED_SHAPES_EVAL_DATA, EMBEDDED_SHAPES_TRAIN_DATA, EMBEDDED_VLM_DIR

    eval_rows = tmp_path / "eval.jsonl"  # 8 of the 200 eval pictures: an eval in seconds
    with EMBEDDED_SHAPES_EVAL_DATA.open() as rows:
        picked = [json.loads(next(rows)) for _ in range(8)]
    for row in picked:
        row["images"] = [str(EMBEDDED_SHAPES_EVAL_DATA.parent / image) for image in row["images"]]
    eval_rows.write_text("".join(json.dumps(row) + "\n" for row in picked))
    output, records = run_stream(
        tmp_path / "run", "-t", "1", "-i", "1", "-tbs", "4", "-m", str(EMBEDDED_VLM_DIR),
        "-d", str(EMBEDDED_SHAPES_TRAIN_DATA), "-ed", json.dumps({"shapes": str(eval_rows)}), "-rt", "boxed",
        "-mnt", "12", "--lora-rank", "4", "--lora-alpha", "8", "--max-steps", "3", "-ei", "3", "--max-staleness", "0",
    )  # fmt: skip
    train = assert_streamed(records, steps=3, max_staleness=0, groups_per_step=4)
    assert_layout(output, train, "shared_prompt")  # each group's picture computed once
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3]
    assert [r["step"] for r in records if r["kind"] == "sync"] == [1, 2, 3]
    found = re.findall(r"LoRA: the weight sync carries \d+ adapter tensors, \d+ bytes = ([0-9.]+)% of the full", output)
    assert found and float(found[-1]) <= ADAPTER_PERCENT, found
    assert all(r["off_policy/logprob_abs_diff"] < SAME_POLICY_LOGPROB_DIFF for r in train), [
        r["off_policy/logprob_abs_diff"] for r in train
    ]
    (run_dir,) = list((tmp_path / "run").iterdir())
    final = run_dir / "final"
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 4
    base, trained = load_file(EMBEDDED_VLM_DIR / "model.safetensors"), load_file(final / "model.safetensors")
    moved = [name for name in base if not torch.equal(base[name], trained[name])]
    assert moved and all(name.startswith("model.layers.") for name in moved), moved  # adapted: the language model's
