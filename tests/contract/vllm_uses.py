"""What our vLLM backend reads from vLLM objects, found in its source (AST), and whether vLLM 0.7.3 has it.

A use is ``receiver.name`` (read or called) or ``hasattr(receiver, "name")`` where the receiver is a vLLM object:
``vllm`` itself, ``self.llm`` (the engine), a worker or a model handed to our functions by ``collective_rpc``.
``RECEIVER_TYPES`` says which vLLM class each receiver is; a receiver rooted at a vLLM object but missing there is
reported, so a new use cannot go unchecked. A class whose module needs libcuda to import (``vllm.worker.worker``)
is read from source, its own body only. Calls are bound to the real signature (positional count, keyword names).
Needs a process that can ``import vllm``; used by ``vllm_probe.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm
from vllm.model_executor.models import ModelRegistry

RECEIVER_TYPES: dict[str, tuple[str, ...]] = {
    # vllm_backend.py: ``self.llm`` and what our code reaches through it.
    "self.llm": ("vllm.entrypoints.llm:LLM",),
    "self.llm.llm_engine": ("vllm.engine.llm_engine:LLMEngine",),
    "self.llm.llm_engine.model_executor": (
        "vllm.executor.uniproc_executor:UniProcExecutor",  # -ptp 1
        "vllm.executor.mp_distributed_executor:MultiprocessingDistributedExecutor",  # -ptp > 1 ("mp")
    ),
    # vllm_weights.py: collective_rpc hands each function the worker (vllm/utils.py run_method).
    "worker": ("vllm.worker.worker:Worker",),
    "worker.model_runner": ("vllm.worker.model_runner:ModelRunner",),
}
"""The vLLM type behind each receiver our code uses; a path rooted at a vLLM object but missing here is a problem."""
MODEL_RECEIVERS = ("model", "worker_model()")
"""Receivers holding the vLLM model of one of ``SUPPORTED_ARCHITECTURES`` (resolved through vLLM's registry)."""
VLLM_ROOTS = ("self.llm", "worker", "vllm", *MODEL_RECEIVERS)


@dataclass(frozen=True)
class VllmType:
    """A vLLM class (or the ``vllm`` module) as far as our code needs it."""

    label: str
    names: frozenset[str]
    """Methods, class attributes, annotated and ``self.``-assigned instance attributes."""
    obj: Any | None
    """The imported object, for signatures; None when read from source only."""


# --- reading types ----------------------------------------------------------------------------------------------


def self_assigned(tree: ast.AST) -> set[str]:
    """``X`` of every ``self.X = ...``, ``self.X: T = ...`` and ``self.X: T`` in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def class_from_source(module_name: str, class_name: str) -> VllmType:
    """A class of a module that cannot be imported here, from its source file (its own body only)."""
    spec = importlib.util.find_spec(module_name)
    tree = ast.parse(Path(spec.origin).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    members |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return VllmType(f"{module_name}:{class_name} (source)", frozenset(members | self_assigned(node)), None)


def imported_class(cls: type) -> VllmType:
    names = set(dir(cls))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            names |= self_assigned(ast.parse(inspect.getsource(klass).lstrip()))
        except (OSError, TypeError, SyntaxError, IndentationError):
            pass  # builtins and classes without source add only what dir() shows
    return VllmType(f"{cls.__module__}:{cls.__qualname__}", frozenset(names), cls)


@functools.cache
def load_type(spec: str) -> VllmType:
    module_name, class_name = spec.split(":")
    try:
        return imported_class(getattr(importlib.import_module(module_name), class_name))
    except ImportError:  # needs libcuda
        return class_from_source(module_name, class_name)


def model_types(architectures: Iterable[str]) -> tuple[VllmType, ...]:
    return tuple(imported_class(ModelRegistry.resolve_model_cls([arch])[0]) for arch in sorted(architectures))


def receiver_types(path: str, models: tuple[VllmType, ...]) -> tuple[VllmType, ...] | None:
    """The vLLM types ``path`` may hold; None if our table does not know it."""
    if path in RECEIVER_TYPES:
        return tuple(load_type(spec) for spec in RECEIVER_TYPES[path])
    if path in MODEL_RECEIVERS:
        return models
    if path == "vllm":
        return (VllmType("vllm", frozenset(dir(vllm)), vllm),)
    if path.startswith("vllm."):
        obj: Any = vllm
        for part in path.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is None:
            return None
        return (imported_class(obj),) if isinstance(obj, type) else (VllmType(path, frozenset(dir(obj)), obj),)
    return None


# --- reading our code -------------------------------------------------------------------------------------------


def dotted(node: ast.AST) -> str | None:
    """``self.llm.generate`` for the expression's AST; a call ``f(...)`` of a plain name renders as ``f()``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return f"{node.func.id}()"
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def is_vllm_path(path: str) -> bool:
    return any(path == root or path.startswith(root + ".") for root in VLLM_ROOTS)


@dataclass(frozen=True)
class Use:
    receiver: str
    name: str
    line: int
    call: ast.Call | None = None


def vllm_uses(source: str) -> list[Use]:
    """Every attribute read or called on a vLLM object, and every ``hasattr(vllm_object, "name")``."""
    tree = ast.parse(source)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (receiver := dotted(node.value)) and is_vllm_path(receiver):
            uses.append(Use(receiver, node.attr, node.lineno, calls.get(id(node))))
        elif isinstance(node, ast.Call) and dotted(node.func) == "hasattr" and len(node.args) == 2:
            receiver, name = dotted(node.args[0]), node.args[1]
            if receiver and is_vllm_path(receiver) and isinstance(name, ast.Constant):
                uses.append(Use(receiver, name.value, node.lineno))
    return uses


def call_problem(vllm_type: VllmType, name: str, call: ast.Call) -> str | None:
    """Whether ``call``'s positional count and keyword names bind to the signature of ``vllm_type.name``."""
    if vllm_type.obj is None:
        return None  # source-only type: existence is all we can check
    target = getattr(vllm_type.obj, name)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    placeholders = [object()] * len(call.args)
    if isinstance(vllm_type.obj, type) and inspect.isfunction(inspect.getattr_static(vllm_type.obj, name)):
        placeholders.append(object())  # self
    keywords = {k.arg: object() for k in call.keywords if k.arg is not None}
    starred = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
    try:
        (signature.bind_partial if starred else signature.bind)(*placeholders, **keywords)
    except TypeError as error:
        return f"{vllm_type.label}.{name}{signature}: {error}"
    return None


def use_problems(source: str, label: str, models: tuple[VllmType, ...]) -> list[str]:
    problems = []
    for use in vllm_uses(source):
        where = f"{label}:{use.line} {use.receiver}.{use.name}"
        types = receiver_types(use.receiver, models)
        if types is None:
            problems.append(f"{where}: no vLLM type known for {use.receiver!r} (add it to RECEIVER_TYPES)")
            continue
        for vllm_type in types:
            if use.name not in vllm_type.names:
                problems.append(f"{where}: {vllm_type.label} has no {use.name!r}")
            elif use.call is not None and (problem := call_problem(vllm_type, use.name, use.call)):
                problems.append(f"{where}: {problem}")
    return problems
