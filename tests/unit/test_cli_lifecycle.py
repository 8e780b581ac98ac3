"""rl_example.py's checkpoint, resume and output-directory flags: reach the config; bad values fail by name."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from colossal_rl.run_checkpoints import on_disk as ckpt

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root, not part of the package

from rl_example import UsageError, build_parser, config_from_args, main  # noqa: E402


def config_for(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_lifecycle_flags_reach_the_run_config():
    config = config_for(
        "-cp", "runs/x", "-si", "5", "--save-limit", "2", "-esd", "evals", "-rsd", "rolls",
        "--log-rollout-interval", "7", "--overwrite-eval-dir", "--warmup-steps", "10",
    )  # fmt: skip
    run = config.run
    assert (run.checkpoint_path, run.save_interval, run.save_limit) == ("runs/x", 5, 2)
    assert (run.eval_save_dir, run.rollout_save_dir, run.log_rollout_interval) == ("evals", "rolls", 7)
    assert run.overwrite_eval_dir and config.train.warmup_steps == 10


@pytest.mark.parametrize(("flag", "value"), [("--save-limit", "-1"), ("--log-rollout-interval", "-2")])
def test_negative_lifecycle_values_name_the_flag(flag, value):
    with pytest.raises(UsageError, match=f"^{flag}: must be >= 0"):
        config_for(flag, value)


def error_of_main(argv, caplog) -> str:
    with caplog.at_level("ERROR"):
        assert main(argv) == 2
    return caplog.records[-1].getMessage()


def test_existing_eval_dir_is_refused_before_anything_starts(tmp_path, caplog):
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "math_step_0.jsonl").write_text("{}\n")
    message = error_of_main(["-esd", str(tmp_path / "evals"), "--no-wandb", "-sd", str(tmp_path / "runs")], caplog)
    assert "-esd/--eval-save-dir" in message and "--overwrite-eval-dir" in message
    assert not (tmp_path / "runs").exists(), "nothing may start when the eval dir is refused"


def test_resume_with_changed_batch_layout_is_refused_naming_the_fields(tmp_path, caplog):
    saved_config = config_for()
    staging = ckpt.staging_dir(tmp_path / "checkpoints", 4)
    state = ckpt.RunState(
        progress=ckpt.RunProgress(step=4, policy_version=4, next_eval_step=20, eval_accuracy_before={}),
        run_dir=str(tmp_path),
        config=json.loads(json.dumps(dataclasses.asdict(saved_config))),
        schedule={"format": 1, "rounds_trained": 4, "next_round": 5},
    )  # fmt: skip
    ckpt.commit(staging, state, {})
    message = error_of_main(["-cp", str(tmp_path), "-ibs", "32", "-tbs", "32", "--no-wandb"], caplog)
    assert "step_000004" in message and "schedule.inference_batch_size: 16 -> 32" in message


def test_resume_from_a_directory_without_checkpoints_names_it(tmp_path, caplog):
    message = error_of_main(["-cp", str(tmp_path), "--no-wandb"], caplog)
    assert str(tmp_path) in message and "no complete checkpoint" in message
