"""Imports go one way (STYLE.md): no circle among ``colossal_rl``'s modules, and no import of a higher layer.

The architecture, bottom to top; a unit is a top-level module or package of ``colossal_rl`` (``reward/`` is
installed as ``colossal_rl.reward``). A unit imports only units of lower layers: never one above, and never
another unit of its own layer (units of one layer are independent of each other):

  1. leaves            lazy_exports, third_party_noise, profiling, metrics, run_outputs, prompts, local_ray,
                       ray_address, env_builds, node_probes, model_size, hf_compat: import nothing of ours
  2. foundations       algorithms (pure tensor math), vision, moe (routing math, MoE blocks), schedule (pure state
                       machines), reward, startup, nvidia_driver
  3. config            the frozen run config
  4.                   config_fields, config_resolve
  5.                   presets
  6. config I/O        config_files, flags
  7. command line      command_line: argv -> a resolved config; knows nothing of how a run is launched
  8. rollout data      batch, data_sources
  9.                   data: datasets and their episodes
 10.                   environments
 11.                   input_checks: what a run reads, checked before Ray starts
 12. comm              collective groups, weight sync, the rollout buffer: all distributed I/O
 13. lora_weights      LoRA's names and merge: what both the producers and the trainers need of LoRA
 14. run_checkpoints   a checkpoint's on-disk layout, one trainer's state (the driver's save and resume is driver/'s)
 15. rollout|training  the producer and the trainer, each constructible without Ray, neither importing the other
 16.                   trainer_nccl: the trainers' NCCL release
 17.                   producer_env: the vLLM producers' Python environment (its build also installs 16)
 18. driver            placement, the actor shells and groups, the driver loop; its files import downwards only
 19. tools             plot

An import is an edge wherever it is written: at module level, inside a function, and under ``if TYPE_CHECKING``
(a type-only import still couples the two modules); ``from package import name`` is an edge to the submodule
``package.name`` when there is one, else to the package; relative imports are resolved. A string naming one of
our modules (``"colossal_rl.rollout.vllm_worker.WeightLoaderExtension"``, a lazy export's module) is an edge too:
it is imported by name at run time. A package's ``__init__`` being run before its submodules is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "colossal_rl"
SOURCE_ROOTS = {PACKAGE: REPO / "colossal_rl", f"{PACKAGE}.reward": REPO / "reward"}

LAYERS = (
    "lazy_exports third_party_noise profiling metrics run_outputs prompts local_ray ray_address env_builds "
    "node_probes model_size hf_compat",
    "algorithms vision moe schedule reward startup nvidia_driver",
    "config",
    "config_fields config_resolve",
    "presets",
    "config_files flags",
    "command_line",
    "batch data_sources",
    "data",
    "environments",
    "input_checks",
    "comm",
    "lora_weights",
    "run_checkpoints",
    "rollout training",
    "trainer_nccl",
    "producer_env",
    "driver",
    "plot",
)
"""Bottom to top: the units of each layer (see the module docstring)."""

LAYER_OF = {unit: index for index, layer in enumerate(LAYERS) for unit in layer.split()}


def module_files() -> dict[str, Path]:
    """Every module of the installed package -> its file."""
    modules = {}
    for prefix, root in SOURCE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((prefix, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest of our modules that ``name`` (a module, or a module's attribute) starts with."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``module`` imports, anywhere in its file (see the module docstring)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_resolve(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([source] if source else []))
            found.update(_resolve(f"{source}.{alias.name}", modules) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PACKAGE + "."):
            target = _resolve(node.value, modules)
            if target in (node.value, node.value.rpartition(".")[0]):  # exactly a module, or a module's attribute
                found.add(target)
    found.discard(None)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def unit_of(module: str) -> str | None:
    """``colossal_rl.rollout.producer`` -> ``rollout``; None for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            unit, target_unit = unit_of(module), unit_of(target)
            if None in (unit, target_unit) or unit == target_unit:
                continue
            layer, target_layer = LAYER_OF.get(unit, -1), LAYER_OF.get(target_unit, -1)
            if target_layer >= layer:
                found.append(f"{module} (layer {layer + 1}) imports {target} (layer {target_layer + 1})")
    return found


def test_every_unit_has_a_layer():
    units = {unit_of(module) for module in module_files()} - {None}
    assert sorted(units - set(LAYER_OF)) == [], "add the new module or package to LAYERS (and the docstring)"
    assert sorted(set(LAYER_OF) - units) == [], "LAYERS names a unit that no longer exists"


def test_no_import_circle():
    found = circles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in found)


def test_no_upward_import():
    found = upward_imports(import_graph())
    assert found == [], "imports of a higher layer or of a unit of the same layer:\n" + "\n".join(found)


def test_the_checker_sees_circles_and_upward_imports():
    graph = {"colossal_rl.comm.a": {"colossal_rl.comm.b"}, "colossal_rl.comm.b": {"colossal_rl.comm.a"}}
    assert circles(graph) == [["colossal_rl.comm.a", "colossal_rl.comm.b"]]
    assert upward_imports({"colossal_rl.config": {"colossal_rl.driver.launch"}, "colossal_rl.driver.launch": set()})
    assert upward_imports({"colossal_rl.rollout.producer": {"colossal_rl.training.lora"}})  # same layer
    assert not upward_imports({"colossal_rl.rollout.producer": {"colossal_rl.lora_weights"}})


def test_the_checker_reads_every_kind_of_import(tmp_path):
    source = tmp_path / "stream.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import buffer\n"
        "from ..config import RLConfig\n"
        "if TYPE_CHECKING:\n"
        "    from colossal_rl.rollout.producer import Producer\n"
        "def later():\n"
        "    import colossal_rl.metrics\n"
        "EXTENSION = 'colossal_rl.rollout.vllm_worker.WeightLoaderExtension'\n"
    )
    modules = dict.fromkeys(
        [
            "colossal_rl.comm",
            "colossal_rl.comm.buffer",
            "colossal_rl.config",
            "colossal_rl.metrics",
            "colossal_rl.rollout.producer",
            "colossal_rl.rollout.vllm_worker",
        ],
        source,
    )
    assert imports_of("colossal_rl.comm.stream", source, modules) == {
        "colossal_rl.comm.buffer",
        "colossal_rl.config",
        "colossal_rl.rollout.producer",
        "colossal_rl.metrics",
        "colossal_rl.rollout.vllm_worker",
    }
