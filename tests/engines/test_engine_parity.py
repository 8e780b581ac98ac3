"""The FSDP2 engine trains exactly as the ColossalAI engine: one step, the same batch, on 1 and 2 ranks.

``engine_steps.py`` runs the cases under each engine's own interpreter: ColossalAI's DDP plugin in the trainers'
environment (torch 2.5.1, transformers 4.51.3), FSDP2 in the producers' (torch 2.13, transformers 5.19; built on first
use, so this file is in the producers'-environment tier). Checked, FSDP2 against ColossalAI for GRPO and DAPO in the
padded, packed and shared-prompt layouts on 1 and 2 ranks (fp32): the full state dict's names and shapes, the step
loss to 1e-5, the gradient within 1e-5 of its largest element, the weights after one AdamW step to 1e-5 (absolute; an lr of 1e-3) and the
gradient norm before clipping to 1e-5 (relative); and two FSDP2 ranks, each with half the groups, equal one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.vllm]

SCRIPT = Path(__file__).with_name("engine_steps.py")
ALGORITHMS = ("GRPO", "DAPO")
LAYOUTS = ("padded", "packed", "shared_prompt")
RANKS = (1, 2)
DEADLINE_S = 400


@pytest.fixture(scope="module")
def results(tmp_path_factory, producer_python) -> dict:
    out_dir = tmp_path_factory.mktemp("engine_parity")
    runs = [
        subprocess.Popen(
            [python, str(SCRIPT), "--engine", engine, "--world-size", str(world_size), "--out", str(out_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for engine, python in (("colossalai", sys.executable), ("fsdp2", producer_python))
        for world_size in RANKS
    ]
    for run in runs:
        output, _ = run.communicate(timeout=DEADLINE_S)
        assert run.returncode == 0, f"{run.args}:\n{output[-6000:]}"
    return {
        (engine, n): torch.load(out_dir / f"{engine}_ranks{n}.pt") for engine in ("colossalai", "fsdp2") for n in RANKS
    }


@pytest.mark.parametrize("world_size", RANKS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_step_equals_the_colossalai_step(results, world_size, algorithm, layout):
    reference = results[("colossalai", world_size)][(algorithm, layout)]
    fsdp2 = results[("fsdp2", world_size)][(algorithm, layout)]
    assert fsdp2["shapes"] == reference["shapes"]
    assert fsdp2["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6)
    scale = float(reference["gradient"].abs().max())
    assert scale > 0
    torch.testing.assert_close(fsdp2["gradient"], reference["gradient"], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(fsdp2["weights"], reference["weights"], rtol=0, atol=1e-5)
    assert fsdp2["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_two_fsdp2_ranks_equal_one(results, algorithm):
    """Splitting the step over two FSDP2 ranks (each its half of the groups) equals one rank's step on them all."""
    one, two = results[("fsdp2", 1)][(algorithm, "padded")], results[("fsdp2", 2)][(algorithm, "padded")]
    torch.testing.assert_close(two["weights"], one["weights"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two["gradient"], one["gradient"], rtol=0, atol=1e-5 * float(one["gradient"].abs().max()))
