"""Checkpoint layout: atomic commit, retention, ``-cp`` resolution, resume-invariant fields; eval dir refusal."""

from __future__ import annotations

import dataclasses
import json

import pytest

from colossal_rl.config import RLConfig, ScheduleConfig
from colossal_rl.run_checkpoints import on_disk as ckpt
from colossal_rl.run_outputs import OutputDirError, prepare_eval_dir, write_eval_generations


def state(step: int, run_dir: str = "run") -> ckpt.RunState:
    return ckpt.RunState(
        progress=ckpt.RunProgress(
            step=step,
            policy_version=step,
            dropped_stale_groups=0,
            next_eval_step=20,
            eval_accuracy_before={"math": 0.2},
        ),
        run_dir=run_dir,
        config={"schedule": {"n_behind": 1}},
        schedule={"format": 1, "rounds_trained": step, "delivered": [[step + 1, 0, [[3, 0, 5, step, 40, 7]]]]},
    )


NO_CHUNKS: dict[int, ckpt.SavedChunk] = {}


def save(checkpoints, step: int):
    staging = ckpt.staging_dir(checkpoints, step)
    (staging / "trainer").mkdir()
    return ckpt.commit(staging, state(step), NO_CHUNKS)


def test_commit_renames_a_complete_directory_and_round_trips_the_state(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    staging = ckpt.staging_dir(checkpoints, 4)
    assert staging.name.startswith(".") and ckpt.complete_checkpoints(checkpoints) == []
    chunks = {
        3: ckpt.SavedChunk(payload=b"wire bytes of chunk 3", batch_rows=(5, 2), producer_rank=0),
        4: ckpt.SavedChunk(payload=b"wire bytes of chunk 4", batch_rows=(0,), producer_rank=1),
    }
    final = ckpt.commit(staging, state(4), chunks)
    assert final == checkpoints / "step_000004" and not staging.exists()
    assert ckpt.load_state(final) == state(4)
    assert ckpt.load_chunks(final) == chunks


def test_interrupted_save_is_not_a_checkpoint_and_is_cleared_on_the_next_try(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    save(checkpoints, 2)
    half = ckpt.staging_dir(checkpoints, 4)
    (half / "trainer").mkdir()  # killed here: no state.json, never renamed
    assert [p.name for p in ckpt.complete_checkpoints(checkpoints)] == ["step_000002"]
    assert ckpt.resolve(tmp_path) == checkpoints / "step_000002"
    assert not any(ckpt.staging_dir(checkpoints, 4).iterdir()), "a retry starts from an empty staging dir"


def test_prune_keeps_the_newest_and_resolve_accepts_run_checkpoints_or_checkpoint_dirs(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4, 10, 6):
        save(checkpoints, step)
    removed = ckpt.prune(checkpoints, keep=2)
    assert [p.name for p in removed] == ["step_000002", "step_000004"]
    assert [p.name for p in ckpt.complete_checkpoints(checkpoints)] == ["step_000006", "step_000010"]
    assert ckpt.resolve(tmp_path) == ckpt.resolve(checkpoints) == checkpoints / "step_000010"
    assert ckpt.resolve(checkpoints / "step_000006") == checkpoints / "step_000006"
    assert ckpt.resolve(checkpoints / "step_6") == checkpoints / "step_000006"  # the step without the padding
    with pytest.raises(ckpt.CheckpointError, match="step_7: no complete checkpoint"):
        ckpt.resolve(checkpoints / "step_7")
    assert ckpt.prune(checkpoints, keep=0) == []
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve(tmp_path / "elsewhere")


def test_state_file_stays_flat_and_a_file_of_the_buffer_era_is_refused_by_name(tmp_path):
    checkpoint = save(tmp_path / "checkpoints", 4)
    on_disk = json.loads((checkpoint / ckpt.STATE_FILE).read_text())
    assert on_disk["step"] == 4 and on_disk["eval_accuracy_before"] == {"math": 0.2} and "progress" not in on_disk
    assert on_disk["schedule"] == state(4).schedule
    earlier = {  # a state.json as the driver wrote it beside a buffer.pt, before the scheduler's snapshot
        "step": 6, "next_round": 3, "policy_version": 3, "dropped_stale_groups": 1, "next_eval_step": 10,
        "eval_accuracy_before": {}, "run_dir": "run", "config": {}, "pending_rollout_metrics": {},
    }  # fmt: skip
    (checkpoint / ckpt.STATE_FILE).write_text(json.dumps(earlier))
    with pytest.raises(ckpt.CheckpointError, match=r"state\.json: unreadable run state .*no 'schedule'.*buffer\.pt"):
        ckpt.load_state(checkpoint)
    (checkpoint / ckpt.STATE_FILE).write_text(json.dumps({**on_disk, "stepp": 1}))
    with pytest.raises(ckpt.CheckpointError, match="unknown keys"):
        ckpt.load_state(checkpoint)


def test_an_unreadable_chunks_file_names_it(tmp_path):
    checkpoint = save(tmp_path / "checkpoints", 4)
    whole = (checkpoint / ckpt.CHUNKS_FILE).read_bytes()
    (checkpoint / ckpt.CHUNKS_FILE).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ckpt.CheckpointError, match=r"chunks\.pt: unreadable"):
        ckpt.load_chunks(checkpoint)


def test_unreadable_state_names_the_file(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match=r"state\.json: unreadable"):
        ckpt.load_state(tmp_path)


def test_resume_mismatches_name_fields_that_decide_the_data_and_ignore_the_rest():
    saved = json.loads(json.dumps(dataclasses.asdict(RLConfig())))
    longer = dataclasses.replace(RLConfig(), schedule=ScheduleConfig(num_episodes=3, max_steps=500))
    assert ckpt.resume_mismatches(saved, json.loads(json.dumps(dataclasses.asdict(longer)))) == []
    other = dataclasses.replace(RLConfig(), schedule=ScheduleConfig(num_producers=2, inference_batch_size=8))
    problems = ckpt.resume_mismatches(saved, json.loads(json.dumps(dataclasses.asdict(other))))
    assert problems == ["schedule.num_producers: 1 -> 2", "schedule.inference_batch_size: 16 -> 8"]


def test_a_checkpoint_from_before_a_field_existed_resumes_with_its_default():
    saved = json.loads(json.dumps(dataclasses.asdict(RLConfig())))
    del saved["data"]["prompt_key"], saved["data"]["answer_key"]  # written before the column mapping existed
    now = json.loads(json.dumps(dataclasses.asdict(RLConfig())))
    assert ckpt.resume_mismatches(saved, now) == []
    other = dataclasses.replace(RLConfig(), data=dataclasses.replace(RLConfig().data, answer_key="solution"))
    problems = ckpt.resume_mismatches(saved, json.loads(json.dumps(dataclasses.asdict(other))))
    assert problems == ["data.answer_key: 'gt_answer' -> 'solution'"]


def test_eval_dir_with_files_is_refused_unless_overwrite_is_allowed(tmp_path):
    directory = prepare_eval_dir(tmp_path / "eval", overwrite=False)
    write_eval_generations(directory, 0, {"math": [{"index": 1, "correct": True}, {"index": 0, "correct": False}]})
    lines = (directory / "math_step_0.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1]
    with pytest.raises(OutputDirError, match="-esd/--eval-save-dir .* --overwrite-eval-dir"):
        prepare_eval_dir(directory, overwrite=False)
    assert prepare_eval_dir(directory, overwrite=True) == directory


def test_prune_removes_interrupted_saves_older_than_the_newest_whole_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4, 8):
        save(checkpoints, step)
    for step in (3, 9):  # interrupted saves: a directory without state.json
        (checkpoints / ckpt.checkpoint_name(step)).mkdir()
    removed = ckpt.prune(checkpoints, keep=2)
    assert [p.name for p in removed] == ["step_000002", "step_000003"]
    # step 9 is newer than every whole checkpoint: it may be a save still being written, so it stays
    assert [p.name for p in ckpt.checkpoint_dirs(checkpoints)] == ["step_000004", "step_000008", "step_000009"]


def test_either_schedulers_snapshot_round_trips_through_the_state_file(tmp_path):
    from colossal_rl.schedule.events import FinishedGroup
    from colossal_rl.schedule.rounds import RoundScheduler, RoundSettings
    from colossal_rl.schedule.streaming import StreamingScheduler, StreamingSettings

    rows = lambda episode: list(range(8))  # noqa: E731
    rounds = RoundScheduler(
        RoundSettings(num_producers=2, prompts_per_producer=2, groups_per_step=2, n_behind=1, total_rounds=2), rows
    )
    for order in rounds.admit():  # -nb 1: rounds 0 and 1 ordered at once
        rounds.chunk_done(order.chunk_id, [FinishedGroup(row, order.policy_version, tokens=9) for row in order.rows])
    assert rounds.next_step() is not None
    rounds.step_done()  # round 0 trained; round 1 generated and not trained
    stream = StreamingScheduler(
        StreamingSettings(num_producers=1, groups_per_step=2, prompts_per_chunk=2, max_staleness=1, total_steps=3),
        rows,
    )
    stream.admit()
    for step, scheduler in enumerate((rounds, stream)):
        saved = dataclasses.replace(state(step), schedule=scheduler.snapshot())
        final = ckpt.commit(ckpt.staging_dir(tmp_path / "checkpoints", step), saved, NO_CHUNKS)
        assert ckpt.load_state(final) == saved
    round_snapshot = ckpt.load_state(tmp_path / "checkpoints" / "step_000000").schedule
    assert round_snapshot["rounds_trained"] == 1 and [r for r, _, _ in round_snapshot["delivered"]] == [1, 1]
    again = RoundScheduler(rounds.settings, rows)
    again.restore(round_snapshot)  # the JSON round trip loses nothing the scheduler needs
    assert again.snapshot() == rounds.snapshot()


def test_the_schedule_mode_may_not_change_on_resume():
    saved = json.loads(json.dumps(dataclasses.asdict(RLConfig())))  # a checkpoint written before the field: rounds
    del saved["schedule"]["mode"]
    stream = RLConfig(schedule=ScheduleConfig(mode="stream"))
    assert ckpt.resume_mismatches(saved, json.loads(json.dumps(dataclasses.asdict(stream)))) == [
        "schedule.mode: 'rounds' -> 'stream'"
    ]
