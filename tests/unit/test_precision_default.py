"""The training precision follows the trainers' device by default: bf16 on GPUs, fp32 on CPU (issue 33, item 1).

Before, ``parallel.precision`` defaulted to fp32 everywhere, so a GPU run trained in fp32 unless the user knew to
pass ``--precision bf16``. Now the default is ``auto``: the driver resolves it from the Ray cluster's GPUs (what
``plan_placement`` places the trainers on) before any actor starts, and the run directory's config.yaml holds the
resolved value; trainers and producers resolve an unresolved config the same way on their own device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colossal_rl.config import ConfigError, RLConfig, resolve_precision, with_device_precision
from colossal_rl.config_resolve import resolve
from colossal_rl.driver.placement import PlacementError, resolve_precision_for_cluster
from colossal_rl.run_checkpoints import on_disk as ckpt
from rl_example import UsageError, build_parser, config_from_args


def config_for(*argv: str) -> RLConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def ray_nodes(gpus: int) -> list[dict]:
    return [{"NodeID": "n0", "Alive": True, "Resources": {"CPU": 8.0, "GPU": float(gpus)}}]


def test_the_default_precision_is_bf16_on_gpus_and_fp32_on_cpu():
    assert RLConfig().parallel.precision == config_for().parallel.precision == "auto"
    assert resolve_precision("auto", on_gpu=True) == "bf16"
    assert resolve_precision("auto", on_gpu=False) == "fp32"
    assert resolve_precision("fp16", on_gpu=True) == "fp16" and resolve_precision("bf16", on_gpu=False) == "bf16"
    assert resolve_precision_for_cluster(config_for(), ray_nodes(gpus=8)).parallel.precision == "bf16"
    assert resolve_precision_for_cluster(config_for(), ray_nodes(gpus=0)).parallel.precision == "fp32"
    explicit = config_for("--precision", "fp32")
    assert resolve_precision_for_cluster(explicit, ray_nodes(gpus=8)) is explicit  # a given precision stays


def test_zero_with_tensor_parallelism_under_auto_needs_gpus():
    """auto is bf16 on GPUs (the hybrid plugin's ZeRO runs), fp32 without: refused naming the flag."""
    config = config_for("-t", "2", "-tp", "2", "-zero", "1")
    assert resolve_precision_for_cluster(config, ray_nodes(gpus=8)).parallel.precision == "bf16"
    with pytest.raises(PlacementError, match=r"^--precision: .*bf16.*precision auto is fp32: no GPUs"):
        resolve_precision_for_cluster(config, ray_nodes(gpus=0))


def test_flash_attention_2_is_refused_with_fp32(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a)
    )
    with pytest.raises(UsageError, match=r"^--attn-implementation: flash_attention_2 runs in bf16 or fp16 only"):
        config_for("--attn-implementation", "flash_attention_2", "--precision", "fp32")
    flash = config_for("--attn-implementation", "flash_attention_2")  # auto: decided on the cluster
    assert resolve_precision_for_cluster(flash, ray_nodes(gpus=8)).parallel.precision == "bf16"
    with pytest.raises(PlacementError, match="flash_attention_2 runs in bf16"):
        resolve_precision_for_cluster(flash, ray_nodes(gpus=0))
    with pytest.raises(ConfigError, match="parallel.precision: must be one of auto, fp32, bf16, fp16"):
        dataclasses.replace(RLConfig().parallel, precision="fp64").validate()


def test_a_trainer_given_auto_trains_in_its_device_precision():
    from colossal_rl.training.trainer import Trainer

    trainer = Trainer(0, 1, RLConfig(), "127.0.0.1", 0)
    assert trainer.config.parallel.precision == ("bf16" if torch.cuda.is_available() else "fp32")


@pytest.mark.parametrize(("cuda", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_a_producer_given_auto_holds_its_device_precision(monkeypatch, cuda, dtype):
    import colossal_rl.rollout.producer as producer_module

    class Created(Exception):
        pass

    def fake_create_backend(*args, **kwargs):
        raise Created(kwargs)

    monkeypatch.setattr(producer_module, "create_backend", fake_create_backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(Created) as created:
        producer_module.Producer(0, resolve(RLConfig()), reward_scorer=None)
    assert created.value.args[0]["weights_dtype"] == dtype


def test_a_resume_under_auto_keeps_the_checkpoints_precision(tmp_path):
    from colossal_rl.driver.save_and_resume import checkpoint_to_resume, config_as_json

    saved_config = with_device_precision(RLConfig(), on_gpu=True)  # a GPU run's checkpoint: bf16
    staging = ckpt.staging_dir(tmp_path / "checkpoints", 4)
    (staging / "trainer").mkdir()
    state = ckpt.RunState(progress=ckpt.RunProgress(step=4), run_dir=str(tmp_path), config=config_as_json(saved_config))
    checkpoint = ckpt.commit(staging, state, {})
    resume = dataclasses.replace(RLConfig(), run=dataclasses.replace(RLConfig().run, checkpoint_path=str(checkpoint)))
    found, config = checkpoint_to_resume(resume)
    assert found == checkpoint and config.parallel.precision == "bf16"
    fp32 = dataclasses.replace(resume, parallel=dataclasses.replace(resume.parallel, precision="fp32"))
    with pytest.raises(ckpt.CheckpointError, match="parallel.precision: 'bf16' -> 'fp32'"):
        checkpoint_to_resume(fp32)
