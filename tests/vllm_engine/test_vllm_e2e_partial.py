"""``rl_example.py -b vllm --schedule stream --continuous-batching --partial-rollouts`` end to end (issue 46): weight
syncs land while the engine's requests run, and a producer killed mid-run loses no row. A file of its own, so that
pytest-xdist (``--dist loadfile``) can run it beside the other vLLM end-to-end files."""

from __future__ import annotations

import sys

import pytest
from vllm_runs import ON_POLICY_MAX_LOGPROB_DIFF, REPO, Run, run_dir_in

from colossal_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.dist]

PARTIAL_STREAM = [
    "-b", "vllm", "-t", "1", "-i", "1", "-g", "4", "-ibs", "8", "-imbs", "4", "-tbs", "4", "-tMbs", "4", "-tmbs", "16",
    "-mnt", "32", "--schedule", "stream", "--continuous-batching", "--partial-rollouts", "--no-wandb", "--timeout",
    "300", "-ei", "0", "--no-final-export",
]  # fmt: skip
PARTIAL_STREAM_STEPS = 8


def test_a_stream_run_with_partial_rollouts_on_vllm_trains_every_row_once_across_a_producer_kill(
    producer_python, tmp_path
):
    """``-b vllm --schedule stream --continuous-batching --partial-rollouts``: syncs land while the engine's requests
    run (responses span two versions), every step with staleness 0 has the trainer's log-probs equal to vLLM's, and
    a producer killed mid-run is restarted with a new engine, its lost chunks' rows generated again: every step
    trained, no row twice."""
    run = Run([sys.executable, str(REPO / "rl_example.py"), *PARTIAL_STREAM, "--max-steps", str(PARTIAL_STREAM_STEPS),
               "-sd", str(tmp_path)])  # fmt: skip

    def steps_done() -> int:
        found = list(tmp_path.glob("*/metrics.jsonl"))
        try:
            return sum(r["kind"] == "train" for r in read_metrics(found[0])) if found else 0
        except ValueError:  # a record being written
            return 0

    run.wait_for(lambda: steps_done() >= 2, "two steps trained", timeout_s=600)
    run.kill_a_producer_while_training()
    assert run.finish(timeout_s=900) == 0, run.output[-4000:]
    assert "died and was restarted (1 of --max-actor-restarts 2)" in run.output
    assert "lost with its producer: its rows are handed out again" in run.output
    records = read_metrics(run_dir_in(tmp_path) / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, PARTIAL_STREAM_STEPS + 1))
    trained = [index for record in train for index in record["train/data_indices"]]
    assert len(trained) == len(set(trained)) == 4 * PARTIAL_STREAM_STEPS, "a row was trained twice, or lost"
    on_policy = [r["off_policy/logprob_abs_diff"] for r in train if r["train/staleness"] == 0]
    assert on_policy and max(on_policy) < ON_POLICY_MAX_LOGPROB_DIFF, on_policy
    spans = [r["rollout/multi_version_fraction"] for r in records if r["kind"] == "rollout"]
    assert max(spans) > 0, "no response spanned a sync: partial rollouts never happened"
