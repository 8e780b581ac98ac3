"""The CPU compatibility layer fits the installed ColossalAI, applies once, and stays off where CUDA exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal_rl.training import cpu_compat


def test_patch_targets_exist_with_expected_signatures():
    # Fails loudly, naming the patch, if ColossalAI moved or changed a patched target.
    cpu_compat.check_cpu_compat_targets()


@pytest.mark.parametrize("name", sorted(cpu_compat._ACCELERATOR_PATCHES))
def test_check_names_the_accelerator_patch_whose_target_changed(monkeypatch, name):
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    def upgraded(self, *args, new_argument=None):  # a signature no patch was written for
        pass

    key = f"CpuAccelerator.{name}"
    monkeypatch.setitem(cpu_compat._ORIGINALS, key, upgraded)  # what the check reads once patches are applied
    monkeypatch.setattr(CpuAccelerator, name, upgraded)
    with pytest.raises(cpu_compat.CpuCompatError, match=key):
        cpu_compat.check_cpu_compat_targets()


def test_check_names_the_zero_patch_whose_target_changed(monkeypatch):
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    key = "LowLevelZeroOptimizer._sanity_checks"
    monkeypatch.delitem(cpu_compat._ORIGINALS, key, raising=False)
    monkeypatch.delattr(LowLevelZeroOptimizer, "_sanity_checks")
    with pytest.raises(cpu_compat.CpuCompatError, match=key):
        cpu_compat.check_cpu_compat_targets()


def test_check_names_the_pipeline_patch_whose_target_vanished(monkeypatch):
    from colossalai.pipeline import p2p

    monkeypatch.delattr(p2p, "_check_for_nccl_hccl_backend")
    with pytest.raises(cpu_compat.CpuCompatError, match="Backend.HCCL"):
        cpu_compat.check_cpu_compat_targets()


def test_check_names_the_gloo_collective_patch_whose_target_changed(monkeypatch):
    from colossalai.shardformer.layer import _operation

    key = "shardformer._operation.dist"
    monkeypatch.delitem(cpu_compat._ORIGINALS, key, raising=False)
    monkeypatch.setattr(_operation, "dist", object())  # ColossalAI stopped using torch.distributed there
    with pytest.raises(cpu_compat.CpuCompatError, match=key):
        cpu_compat.check_cpu_compat_targets()


def test_apply_refuses_when_a_target_changed(monkeypatch):
    # Launching on CPU goes through apply: a stale patch set stops the run before anything is patched.
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    def upgraded(self, seed, device):
        pass

    monkeypatch.setattr(cpu_compat, "cpu_compat_needed", lambda: True)
    monkeypatch.setitem(cpu_compat._ORIGINALS, "CpuAccelerator.manual_seed", upgraded)
    monkeypatch.setattr(CpuAccelerator, "manual_seed", upgraded)
    with pytest.raises(cpu_compat.CpuCompatError, match="CpuAccelerator.manual_seed"):
        cpu_compat.apply_cpu_compat_patches()


def test_guard_is_off_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cpu_compat.cpu_compat_needed()
    assert cpu_compat.apply_cpu_compat_patches() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")
def test_apply_is_idempotent_and_patches_the_cpu_accelerator():
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.shardformer.layer import _operation
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    assert cpu_compat.apply_cpu_compat_patches() is True
    patched = {name: getattr(CpuAccelerator, name) for name in cpu_compat._ACCELERATOR_PATCHES}
    sanity_checks, operation_dist = LowLevelZeroOptimizer._sanity_checks, _operation.dist
    assert cpu_compat.apply_cpu_compat_patches() is True
    assert {name: getattr(CpuAccelerator, name) for name in patched} == patched
    assert LowLevelZeroOptimizer._sanity_checks is sanity_checks
    assert _operation.dist is operation_dist
    cpu_compat.check_cpu_compat_targets()  # still checks ColossalAI's originals after patching

    accelerator = CpuAccelerator()
    torch.manual_seed(3)
    state = accelerator.get_rng_state()
    accelerator.manual_seed(3)
    assert torch.equal(accelerator.get_rng_state(), state)
    assert accelerator.device_count() == 1
    with accelerator.stream(accelerator.Stream()):
        accelerator.current_stream().wait_stream(accelerator.Stream())
    accelerator.synchronize()
    accelerator.empty_cache()
    assert dist.Backend.HCCL == "hccl"
    assert _operation.dist.get_world_size is dist.get_world_size  # everything else is torch.distributed
