"""The NCCL abort a timed-out weight sync calls exists in the producers' torch 2.13 (issue 44, item 4).

The producers run inside vLLM workers on torch 2.13, whose ``ProcessGroupNCCL`` has ``abort()``/``shutdown()`` and no
``_shutdown()`` (torch 2.5's spelling): calling the latter only logged, and the stuck kernel kept spinning. The
producers' CPU environment has torch 2.13 without NCCL, so the choice is checked against the classes that torch does
offer (the ``ProcessGroup`` base and ``ProcessGroupGloo``; ``ProcessGroupNCCL`` too where it exists), and the picked
method is called on a real torch 2.13 process group. Torch 2.5.1's side is in ``tests/unit/test_nccl_group_lifecycle.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import datetime, json, logging
import torch, torch.distributed as dist
from colossal_rl.comm.process_group import ABORT_METHODS, abort_method_name, abort_nccl

logging.basicConfig(level=logging.WARNING)  # abort_nccl reports a missing or failing abort on stderr
names = [name for name in ("ProcessGroupNCCL", "ProcessGroup", "ProcessGroupGloo") if hasattr(dist, name)]
live = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
abort_nccl(live, "probe")
print(json.dumps({
    "torch": torch.__version__,
    "picked": {name: abort_method_name(getattr(dist, name)) for name in names},
    "offered": {name: [m for m in ABORT_METHODS if callable(getattr(getattr(dist, name), m, None))] for name in names},
    "picked_live": abort_method_name(live),
}))
"""


def test_torch_2_13_offers_the_abort_the_group_picks(producer_python):
    done = subprocess.run(
        [producer_python, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["torch"].startswith("2.13"), probe
    assert "ProcessGroup" in probe["picked"], probe
    for name, picked in probe["picked"].items():  # ProcessGroupNCCL among them on a CUDA build
        assert picked == "abort", (name, probe)
        assert "_shutdown" not in probe["offered"][name], (name, probe)  # why torch 2.5's spelling did nothing
    assert probe["picked_live"] == "abort"
    assert "abort" not in done.stderr.lower(), done.stderr  # the real call neither failed nor was missing
