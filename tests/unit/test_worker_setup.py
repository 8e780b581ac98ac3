"""What every producer and trainer process sets up before its work (``actors._configure_worker``)."""

from __future__ import annotations

import os
import subprocess
import sys

IMPORT_THE_TRAINER_STACK = """
import psutil
from colossal_rl.driver.actors import _configure_worker
_configure_worker(1)
import colossalai.booster.plugin  # imports torch._inductor, whose import starts torch's warm compile pool
import colossal_rl.training.trainer
print(len(psutil.Process().children(recursive=True)))
"""


def test_a_worker_starts_no_idle_compile_processes():
    """torch's warm compile pool (1 + one worker per core, each importing torch) is never used by a trainer."""
    env = {key: value for key, value in os.environ.items() if key != "TORCH_WARM_POOL"}
    done = subprocess.run([sys.executable, "-c", IMPORT_THE_TRAINER_STACK], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0", done.stdout
