"""Pipeline stages' weights are received one stage after the other over NCCL, concurrently over gloo (issue 33,
item 11): NCCL documents that one process issuing collectives on several communicators at once can deadlock."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from colossal_rl.comm.weight_sync.bucketed import receive_stages


class RecordingReceiver:
    """A stage's receiver: records when its receive runs and how many receives overlap it."""

    active = 0
    lock = threading.Lock()

    def __init__(self, stage: int, backend: str, log: list):
        self.group = SimpleNamespace(backend=backend)
        self.stage = stage
        self.log = log

    def receive(self):
        with RecordingReceiver.lock:
            RecordingReceiver.active += 1
            self.log.append(("start", self.stage, RecordingReceiver.active))
        time.sleep(0.2)  # a receive waiting inside the collective library
        with RecordingReceiver.lock:
            RecordingReceiver.active -= 1
            self.log.append(("end", self.stage))
        return 5, {f"stage{self.stage}.weight": torch.full((2,), float(self.stage))}


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_stages_are_received_in_stage_order_over_nccl_and_together_over_gloo(backend):
    log: list = []
    version, tensors = receive_stages([RecordingReceiver(stage, backend, log) for stage in range(3)])
    assert version == 5 and list(tensors) == ["stage0.weight", "stage1.weight", "stage2.weight"]
    most_at_once = max(entry[2] for entry in log if entry[0] == "start")
    if backend == "nccl":
        assert log == [("start", 0, 1), ("end", 0), ("start", 1, 1), ("end", 1), ("start", 2, 1), ("end", 2)]
    else:
        assert most_at_once > 1  # the stages' receives overlap
