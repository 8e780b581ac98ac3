"""Device discipline of the trainer's step, checked on a CPU-only machine through a second (fake) device.

The trainer runs a whole round (a reference model for the KL term, several chunks of ``-tMbs`` prompts
per step, recomputed old log-probs) with the accelerator's device set to ``fake_accelerator``'s device:
every input, the reference model and every collective's scalar must be moved there, or an operator mixes
devices and raises — as on a GPU. The same round on the host must give the same numbers, so the fake
device changes where tensors are, not what is computed. Checked by hand (see docs/contributing/testing.md, "Tests
that can fail"): leaving the step's chunks on the host, the reference model on the host, or the data-parallel
sums on the host each makes ``test_round_on_a_second_device_equals_the_host_run`` fail.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from fake_accelerator import FAKE_DEVICE, DeviceMixError, FakeAccelerator, OnAccelerator
from trainer_harness import ensure_process_group, make_batch, make_config, make_trainer

from colossal_rl.config import AlgorithmConfig, replace


def test_fake_accelerator_raises_where_a_gpu_would():
    ensure_process_group()
    import torch.distributed as dist

    with FakeAccelerator():
        on_device = torch.ones(3, device=FAKE_DEVICE)
        assert isinstance(on_device, OnAccelerator) and on_device.device == FAKE_DEVICE
        assert (on_device * 2).cpu().tolist() == [2.0, 2.0, 2.0]  # real values
        with pytest.raises(DeviceMixError, match="same device"):
            on_device + torch.ones(3)
        assert float(on_device.sum() + torch.tensor(1.0)) == 4.0  # host 0-dim scalars mix, as with CUDA
        assert on_device[torch.tensor([0, 2])].cpu().tolist() == [1.0, 1.0]  # host indices, as CUDA allows
        with pytest.raises(DeviceMixError, match="same device"):
            torch.ones(3)[torch.tensor([0], device=FAKE_DEVICE)]
        with pytest.raises(DeviceMixError, match="collective got host tensors"):
            dist.all_reduce(torch.ones(2))
        summed = torch.ones(2, device=FAKE_DEVICE)
        dist.all_reduce(summed)
        assert summed.cpu().tolist() == [1.0, 1.0]


@pytest.fixture
def accelerator_is_the_fake_device():
    """ColossalAI's accelerator reports the fake device (as it reports cuda:N on a GPU), inside the fake."""
    from colossalai.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    with mock.patch.object(accelerator, "get_current_device", lambda self: FAKE_DEVICE), FakeAccelerator():
        yield


def _round_config(**train):
    # Eager attention: torch picks SDPA's kernel by device, so only eager computes identically on both devices.
    return make_config(
        algorithm=replace(AlgorithmConfig(), kl_coeff=0.1),
        train={"attn_implementation": "eager", "learning_rate": 1e-3} | train,
    )


def _steps():
    return [make_batch(seed=seed, shared_prompts=True) for seed in (1, 2, 3)]


LAYOUTS = {
    "padded": {"sequence_layout": "padded"},
    "packed": {"sequence_layout": "packed"},
    "shared_prompt_token_budget": {"sequence_layout": "shared_prompt", "max_tokens_per_microbatch": 40},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_on_a_second_device_equals_the_host_run(request, layout):
    """Every layout's index tensors and masks are built on the samples' device (a GPU fails otherwise)."""
    config = _round_config(**LAYOUTS[layout])
    host = make_trainer(config, device="cpu").train_epochs(_steps(), round_index=0)
    request.getfixturevalue("accelerator_is_the_fake_device")
    trainer = make_trainer(config)
    assert trainer.device == FAKE_DEVICE
    assert all(isinstance(p, OnAccelerator) for p in trainer.model.parameters())
    assert all(isinstance(p, OnAccelerator) for p in trainer.reference_model.parameters())
    on_device = trainer.train_epochs(_steps(), round_index=0)

    assert len(on_device) == len(host) == 3
    for (device_metrics, _), (host_metrics, _) in zip(on_device, host, strict=True):
        for name, value in host_metrics.items():
            if not name.startswith("time/"):
                assert device_metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert host[0][0]["train/kl"] == 0.0  # the policy starts at the reference
    assert host[2][0]["train/kl"] > 0.0


def test_the_device_test_sees_a_reference_model_left_on_the_host(accelerator_is_the_fake_device):
    """Positive control: the same round with the reference model deliberately kept on the host raises."""
    trainer = make_trainer(_round_config())
    trainer.reference_model.to("cpu")
    with pytest.raises(DeviceMixError):
        trainer.train_epochs(_steps()[:1], round_index=0)
