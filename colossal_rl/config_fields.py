"""What the config's dataclass fields say about themselves: a dotted field's value, annotation and docstring,
and how an annotation reads (``X | None``, ``Literal`` choices) — interpreted here once for the flags
(``flags.py``) and the config files (``config_files.py``)."""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import reduce
from typing import Any

from colossal_rl.config import RLConfig


def field_value(config: Any, path: str) -> Any:
    """``config``'s value of a dotted field (``"train.learning_rate"``)."""
    return reduce(getattr, path.split("."), config)


def field_annotation(path: str) -> Any:
    """The type annotation of a dotted config field."""
    node: Any = RLConfig
    annotation: Any = None
    for part in path.split("."):
        annotation = typing.get_type_hints(node)[part]
        node = annotation
    return annotation


def unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (it, False). The config has no other unions."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"config fields are X or X | None, not {annotation!r}")
        return options[0], len(options) < len(typing.get_args(annotation))
    return annotation, False


def literal_choices(annotation: Any) -> tuple | None:
    """The values of a ``Literal`` annotation, None for any other."""
    return tuple(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else None


def field_docs() -> dict[str, str]:
    """``"train.learning_rate"`` -> that field's docstring in ``config.py``, on one line (the flags' help)."""
    import ast
    import inspect

    from colossal_rl import config as config_module

    classes = {
        node.name: node for node in ast.parse(inspect.getsource(config_module)).body if isinstance(node, ast.ClassDef)
    }

    def docs_of(cls: type, prefix: str) -> dict[str, str]:
        found: dict[str, str] = {}
        body = classes[cls.__name__].body
        for statement, following in zip(body, [*body[1:], None], strict=True):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            name = statement.target.id
            value = getattr(cls, "__dataclass_fields__", {}).get(name)
            hints = typing.get_type_hints(cls)
            if value is not None and dataclasses.is_dataclass(hints.get(name)):
                found |= docs_of(hints[name], f"{prefix}{name}.")
            elif isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
                found[f"{prefix}{name}"] = " ".join(str(following.value.value).replace("``", "").split())
        return found

    return docs_of(RLConfig, "")
