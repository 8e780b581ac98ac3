"""Under pipeline parallelism the checkpoint's and the export's full state dict reach global rank 0 in host memory
(issue 33, item 8): each stage moves its part to the host before ``gather_object``; pickled device tensors
would be rebuilt on the destination's GPU, the whole model beside its own stage and optimizer states."""

from __future__ import annotations

import torch
from fake_accelerator import FAKE_DEVICE, FakeAccelerator

import colossal_rl.training.full_state_dict as full_state_dict


def test_each_stage_reaches_the_gather_on_the_host(monkeypatch):
    sent = []

    def gather_object(obj, gathered, dst, group):
        sent.append(obj)
        if gathered is not None:
            gathered[0] = obj
            gathered[1] = {"stage1.weight": torch.ones(2)}  # the other stage's part, as it arrives

    monkeypatch.setattr(full_state_dict.dist, "gather_object", gather_object)
    monkeypatch.setattr(full_state_dict.dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(full_state_dict.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(full_state_dict.dist, "get_world_size", lambda group=None: 2)
    with FakeAccelerator():
        stage = {
            "stage0.weight": torch.arange(4.0, device=FAKE_DEVICE),
            "stage0.bias": torch.zeros(2, device=FAKE_DEVICE),
        }
        merged = full_state_dict.merge_pipeline_stages(stage, pp_group=object())
    (part,) = sent
    assert {name: tensor.device.type for name, tensor in part.items()} == {"stage0.weight": "cpu", "stage0.bias": "cpu"}
    assert torch.equal(part["stage0.weight"], torch.arange(4.0))
    assert list(merged) == ["stage0.weight", "stage0.bias", "stage1.weight"]
    assert {tensor.device.type for tensor in merged.values()} == {"cpu"}
