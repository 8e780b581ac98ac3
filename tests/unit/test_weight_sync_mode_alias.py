"""``--weight-sync-mode files`` and its old name ``checkpoint``: the old name still works from Python, the flag and a
``--config`` file (an old run's ``config.yaml``, so that run still resumes), renamed to ``files`` with one warning;
any other value is refused naming the field."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest

from colossal_rl.config import ConfigError, RLConfig, RunConfig
from colossal_rl.config_files import config_to_yaml, load_config_file
from colossal_rl.config_resolve import resolve
from colossal_rl.run_checkpoints import on_disk as ckpt

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root, not part of the package

from rl_example import UsageError, build_parser, config_from_args, parse_args  # noqa: E402


def deprecation_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "deprecated" in r.getMessage()]


def test_the_old_name_becomes_files_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="colossal_rl.config"):
        config = RLConfig(run=RunConfig(weight_sync_mode="checkpoint")).validate()  # type: ignore[arg-type]
        again = dataclasses.replace(config, run=dataclasses.replace(config.run, seed=3))
    assert config.run.weight_sync_mode == again.run.weight_sync_mode == "files"
    assert deprecation_warnings(caplog) == [
        "run.weight_sync_mode: 'checkpoint' is deprecated, use 'files' (the same setting, renamed)"
    ]


@pytest.mark.parametrize("mode", ["auto", "broadcast", "shm", "files"])
def test_current_names_pass_unchanged_and_silently(mode, caplog):
    with caplog.at_level(logging.WARNING):
        assert RLConfig(run=RunConfig(weight_sync_mode=mode)).validate().run.weight_sync_mode == mode
        assert config_from_args(build_parser().parse_args(["--weight-sync-mode", mode])).run.weight_sync_mode == mode
    assert deprecation_warnings(caplog) == []


def test_the_flag_takes_the_old_name_with_one_warning_and_offers_only_the_new(caplog):
    with caplog.at_level(logging.WARNING):
        config = config_from_args(parse_args(["--weight-sync-mode", "checkpoint"]))
    assert config.run.weight_sync_mode == "files" and len(deprecation_warnings(caplog)) == 1
    assert "{auto,broadcast,shm,files}" in build_parser().format_help()


def test_an_old_runs_config_file_still_resumes_with_files(tmp_path, caplog):
    """An old run directory: its ``config.yaml`` and its checkpoint's ``state.json`` both say ``checkpoint`` (the
    checkpoint itself as a run writes it: the round scheduler's snapshot in ``state.json``, no rollouts pending)."""
    from colossal_rl.driver.save_and_resume import checkpoint_to_resume, config_as_json
    from colossal_rl.driver.schedules import make_scheduler

    saved = resolve(RLConfig())  # what a run writes: the resolved config
    old = config_as_json(saved)
    old["run"]["weight_sync_mode"] = "checkpoint"
    config_yaml = tmp_path / "config.yaml"
    config_yaml.write_text(config_to_yaml(saved).replace("weight_sync_mode: auto", "weight_sync_mode: checkpoint"))
    staging = ckpt.staging_dir(tmp_path / "checkpoints", 2)
    (staging / "trainer").mkdir()
    scheduler, _ = make_scheduler(saved, num_rows=64)
    state = ckpt.RunState(ckpt.RunProgress(step=2), str(tmp_path), config=old, schedule=scheduler.snapshot())
    checkpoint = ckpt.commit(staging, state, chunks={})

    with caplog.at_level(logging.WARNING):
        config = config_from_args(parse_args(["--config", str(config_yaml), "-cp", str(tmp_path)]))
    assert config.run.weight_sync_mode == "files" and len(deprecation_warnings(caplog)) == 1
    assert checkpoint_to_resume(config)[0] == checkpoint
    assert load_config_file(config_yaml).run.weight_sync_mode == "files"


def test_a_wrong_mode_is_refused_naming_the_field(tmp_path, capsys):
    with pytest.raises(ConfigError) as caught:
        RunConfig(weight_sync_mode="disk").validate()  # type: ignore[arg-type]
    assert caught.value.field_path == "run.weight_sync_mode"
    assert str(caught.value) == "run.weight_sync_mode: must be one of auto, broadcast, shm, files, got 'disk'"

    path = tmp_path / "run.yaml"
    path.write_text("run:\n  weight_sync_mode: disk\n")
    with pytest.raises(UsageError) as caught_file:
        config_from_args(parse_args(["--config", str(path)]))
    assert "run.weight_sync_mode / --weight-sync-mode: must be one of auto, broadcast, shm, files, got 'disk'" in str(
        caught_file.value
    )

    with pytest.raises(SystemExit):
        parse_args(["--weight-sync-mode", "disk"])
    assert "--weight-sync-mode: invalid choice: 'disk'" in capsys.readouterr().err


def test_auto_is_shm_on_gpu_clusters_and_broadcast_on_cpu_ones():
    """Producers on the sender's GPU node need no NCCL group with the trainers (docs/gpu.md, "Weight sync on GPUs")."""
    from colossal_rl.config import resolve_weight_sync_mode
    from colossal_rl.driver.placement import resolve_sync_mode_for_cluster

    assert resolve_weight_sync_mode("auto", on_gpu=True) == "shm"
    assert resolve_weight_sync_mode("auto", on_gpu=False) == "broadcast"
    assert resolve_weight_sync_mode("files", on_gpu=True) == "files"  # a choice is kept
    node = {"NodeID": "n0", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0}}
    gpu_node = node | {"Resources": {"CPU": 8.0, "GPU": 8.0}}
    assert RLConfig().run.weight_sync_mode == "auto"
    plenty = FakeShm({"n0": 2**40})
    assert resolve_sync_mode_for_cluster(RLConfig(), [gpu_node], run=plenty).run.weight_sync_mode == "shm"
    assert resolve_sync_mode_for_cluster(RLConfig(), [node], run=plenty).run.weight_sync_mode == "broadcast"
    assert plenty.asked == [["n0"]]  # the trainers' node, once (on CPU nothing is asked)


class FakeShm:
    """A fake cluster's answer to the free-space probe: free bytes of /dev/shm by node id."""

    def __init__(self, free_by_node: dict[str, int]):
        self.free_by_node = free_by_node
        self.asked: list[list[str]] = []

    def __call__(self, function, nodes, args, timeout_s):
        from colossal_rl.comm.weight_sync.shared_memory import free_bytes

        assert function is free_bytes and args == ("/dev/shm",)
        self.asked.append([node_id for node_id, _ in nodes])
        return [self.free_by_node[node_id] for node_id, _ in nodes]


def test_auto_takes_the_broadcast_where_the_region_does_not_fit_a_trainer_nodes_dev_shm(caplog):
    """Two 8-GPU nodes, 8 producers then 8 trainers (the trainers fill node n1). The embedded model's region (two
    bf16 copies on GPUs) fits n1's 1 GiB of /dev/shm but not 64 KiB: auto then takes the broadcast, in one warning
    line naming the node, both sizes and --shm-size. A chosen shm is kept (its sender refuses in one line)."""
    import dataclasses

    from colossal_rl.config import ParallelConfig, ScheduleConfig
    from colossal_rl.driver.placement import resolve_sync_mode_for_cluster
    from colossal_rl.model_size import checkpoint_parameter_count

    nodes = [
        {"NodeID": f"n{i}", "Alive": True, "NodeManagerAddress": f"10.0.0.{i + 1}",
         "Resources": {"CPU": 64.0, "GPU": 8.0} | ({"node:__internal_head__": 1.0} if i == 0 else {})}
        for i in range(2)
    ]  # fmt: skip
    config = dataclasses.replace(RLConfig(), schedule=ScheduleConfig(num_producers=8),
                                 parallel=ParallelConfig(num_trainers=8))  # fmt: skip
    needed = 2 * 2 * checkpoint_parameter_count(config.model.path)  # two slots, bf16
    assert 64 * 2**10 < needed < 2**30
    roomy = FakeShm({"n0": 0, "n1": 2**30})
    assert resolve_sync_mode_for_cluster(config, nodes, run=roomy).run.weight_sync_mode == "shm"
    assert roomy.asked == [["n1"]]  # the trainers' node only
    with caplog.at_level("WARNING", logger="colossal_rl.driver.placement"):
        small = FakeShm({"n0": 2**40, "n1": 64 * 2**10})
        assert resolve_sync_mode_for_cluster(config, nodes, run=small).run.weight_sync_mode == "broadcast"
    (line,) = [record.getMessage() for record in caplog.records]
    assert "--weight-sync-mode auto takes the broadcast, not shm" in line and "10.0.0.2 (node n1)" in line
    assert f"needs {needed / 1e9:.2f} GB of /dev/shm" in line and "--shm-size=1g" in line and "\n" not in line
    chosen = dataclasses.replace(config, run=dataclasses.replace(config.run, weight_sync_mode="shm"))
    assert resolve_sync_mode_for_cluster(chosen, nodes, run=small).run.weight_sync_mode == "shm"  # asked for: kept


@pytest.mark.parametrize(("precision", "bytes_per_parameter"), [("auto", 2), ("fp32", 4)])
def test_a_dev_shm_exactly_the_regions_size_fits_and_one_byte_less_does_not(precision, bytes_per_parameter):
    """The region is two copies of the weights in the training precision (``auto``: bf16, as trainers on GPUs
    resolve it; fp32: four bytes a parameter). Room equal to it is enough; a byte less is not."""
    from colossal_rl.config import ParallelConfig
    from colossal_rl.driver.placement import resolve_sync_mode_for_cluster
    from colossal_rl.model_size import checkpoint_parameter_count

    gpu_node = {"NodeID": "n0", "Alive": True, "NodeManagerAddress": "10.0.0.1",
                "Resources": {"CPU": 8.0, "GPU": 8.0, "node:__internal_head__": 1.0}}  # fmt: skip
    config = dataclasses.replace(RLConfig(), parallel=ParallelConfig(precision=precision))
    needed = 2 * bytes_per_parameter * checkpoint_parameter_count(config.model.path)
    exactly = resolve_sync_mode_for_cluster(config, [gpu_node], run=FakeShm({"n0": needed}))
    assert exactly.run.weight_sync_mode == "shm"
    short = resolve_sync_mode_for_cluster(config, [gpu_node], run=FakeShm({"n0": needed - 1}))
    assert short.run.weight_sync_mode == "broadcast"


def test_an_unresolved_auto_is_never_planned():
    from colossal_rl.comm.weight_sync.modes import plan_routes

    with pytest.raises(ValueError, match="got 'auto'"):
        plan_routes("auto", sender_nodes=["a"], producer_nodes=["a"], addresses=[("127.0.0.1", 1)], run_dir=".",
                    formation=1)  # fmt: skip
