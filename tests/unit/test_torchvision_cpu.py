"""The CPU producer environment's torchvision import hook (``rollout/torchvision_cpu.py``), on a stand-in package
shaped like torchvision 0.28 on torch +cpu: its compiled ops library is missing, and its import registers a fake
kernel for an op that library would have defined. Each case runs in a fresh interpreter (the hook acts on a
package's first import). The real torchvision in the real producer environment: ``tests/vllm_engine``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from colossal_rl.rollout import torchvision_cpu

STAND_IN = "cr_fake_vision"
SCHEMA = "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
STAND_IN_INIT = f"""
import torch

@torch.library.register_fake("{STAND_IN}::nms")  # as torchvision 0.28's _meta_registrations does, unguarded
def meta_nms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)

def resize(x):  # its pure-torch part
    return x[..., ::2, ::2]
"""


@pytest.fixture
def stand_in(tmp_path) -> Path:
    package = tmp_path / STAND_IN
    package.mkdir()
    (package / "__init__.py").write_text(STAND_IN_INIT)
    (package / "_C.so").write_bytes(b"not a shared library")  # an ops library that does not load
    return tmp_path


def run(code: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=path, capture_output=True, text=True, timeout=300)


def test_without_the_hook_the_package_does_not_import(stand_in):
    done = run(f"import {STAND_IN}", stand_in)
    assert done.returncode != 0 and f"operator {STAND_IN}::nms does not exist" in done.stderr


def test_with_the_hook_it_imports_its_python_part_works_and_the_op_has_no_kernel(stand_in):
    code = f"""
import sys, torch
from colossal_rl.rollout import torchvision_cpu
torchvision_cpu.install("{STAND_IN}", ("{SCHEMA}",))
torchvision_cpu.install("{STAND_IN}", ("{SCHEMA}",))  # idempotent
assert sum(isinstance(f, torchvision_cpu._FirstImport) for f in sys.meta_path) == 1
import {STAND_IN}
assert not any(isinstance(f, torchvision_cpu._FirstImport) for f in sys.meta_path)  # stepped aside
assert {STAND_IN}.resize(torch.ones(1, 4, 4)).shape == (1, 2, 2)
try:
    torch.ops.{STAND_IN}.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
except (NotImplementedError, RuntimeError) as error:
    print("no kernel:", type(error).__name__)
"""
    done = run(code, stand_in)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no kernel:" in done.stdout


def test_ops_that_exist_are_not_declared_again(stand_in):
    code = f"""
import torch
from colossal_rl.rollout.torchvision_cpu import declare_unloaded_ops, ops_library_loads
assert not ops_library_loads("{STAND_IN}")
print(declare_unloaded_ops("{STAND_IN}", ("{SCHEMA}",)), declare_unloaded_ops("{STAND_IN}", ("{SCHEMA}",)))
"""
    done = run(code, stand_in)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['nms'] []"


def test_the_hook_file_arms_the_hook_at_interpreter_start(tmp_path):
    path = torchvision_cpu.write_hook_file(str(tmp_path))
    assert path.name == torchvision_cpu.HOOK_FILE
    assert (
        path.read_text()
        == "import colossal_rl.rollout.torchvision_cpu; colossal_rl.rollout.torchvision_cpu.install()\n"
    )
    code = f"""
import site, sys
site.addsitedir({str(tmp_path)!r})  # processes its .pth files, as at start-up
from colossal_rl.rollout import torchvision_cpu
print([f.package for f in sys.meta_path if isinstance(f, torchvision_cpu._FirstImport)])
"""
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['torchvision']"
