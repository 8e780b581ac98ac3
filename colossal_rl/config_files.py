"""The run config as YAML: read any subset of the config tree, write the whole resolved config.

    model:
      path: Qwen/Qwen2.5-0.5B
    train:
      learning_rate: 1.0e-6
      lr_schedule: cosine
    data:
      eval_paths: {gsm8k: gsm8k_test.jsonl}

``python rl_example.py --config run.yaml [flags]``: the file's values replace the defaults and flags given on
the command line replace the file's (``rl_example.py`` does that merge). ``--print-config`` prints the
resolved config in this format, and every run directory keeps it as ``config.yaml``. Errors name the file
and the field (``run.yaml: train.learnign_rate: no such field (train has: ...)``).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from colossal_rl.config import DEPRECATED_VALUES, ConfigError, RLConfig
from colossal_rl.config_fields import literal_choices, unwrap_optional

CONFIG_FILE = "config.yaml"


class ConfigFileError(ValueError):
    """A config file is unreadable or names a field that does not exist or has the wrong type."""


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dicts (tuples as lists, ``eval_paths`` as a task -> source map) for YAML."""
    data = dataclasses.asdict(config)
    eval_paths = config.data.eval_paths
    data["data"]["eval_paths"] = None if eval_paths is None else dict(eval_paths)
    return _plain(data)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def config_to_yaml(config: RLConfig) -> str:
    import yaml

    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The nested mapping of a YAML config file; errors name the file (and line for YAML syntax)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigFileError(f"--config: no such file: {path}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigFileError(f"{where}: invalid YAML ({getattr(error, 'problem', None) or error})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: a config file is a mapping of sections (model:, train:, ...)")
    return data


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"learning_rate": 1e-6}}`` -> ``{"train.learning_rate": 1e-6}`` (leaves only)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not path.endswith("data.eval_paths"):
            flat |= flatten(value, f"{path}.")
        else:
            flat[path] = value
    return flat


def apply_fields(config: RLConfig, fields: dict[str, Any], source: str | None = None) -> RLConfig:
    """``config`` with every ``dotted.path: value`` of ``fields`` set (checked against the field's type).

    A bad field raises :class:`ConfigFileError` naming ``source`` (a file), or without a source the
    config's own :class:`ConfigError` for the field (which the command line maps to its flag)."""
    for path, value in fields.items():
        try:
            config = _replace_path(config, path.split("."), value, path, "")
        except _FieldError as error:
            if source is None:
                raise ConfigError(error.where, error.message) from None
            raise ConfigFileError(f"{source}: {error.where}: {error.message}") from None
    return config


class _FieldError(Exception):
    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


def _replace_path(node: Any, parts: list[str], value: Any, path: str, source: str) -> Any:
    field_map = {f.name: f for f in dataclasses.fields(node)}
    name = parts[0]
    done = path.split(".")[: len(path.split(".")) - len(parts)]
    where = ".".join([*done, name])
    if name not in field_map:
        section = ".".join(done) or "the config"
        raise _FieldError(where, f"no such field ({section} has: {', '.join(field_map)})")
    current = getattr(node, name)
    if len(parts) > 1:
        if not dataclasses.is_dataclass(current):
            raise _FieldError(where, f"not a section, so {path} does not exist")
        return dataclasses.replace(node, **{name: _replace_path(current, parts[1:], value, path, source)})
    hints = typing.get_type_hints(type(node))
    return dataclasses.replace(node, **{name: _coerce(value, hints[name], path, source)})


def _coerce(value: Any, annotation: Any, path: str, source: str) -> Any:
    """``value`` as the field's type: ints for floats, lists for tuples, the eval-paths map; else an error."""
    if path == "data.eval_paths":
        if value is None:  # resolved from the training set (``config_resolve``)
            return None
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return tuple(value.items())
        raise _FieldError(path, "expected a map of task name to dataset source")
    if dataclasses.is_dataclass(annotation):
        raise _FieldError(path, "is a section; give its fields")
    annotation, optional = unwrap_optional(annotation)
    if value is None and optional:
        return None
    choices = literal_choices(annotation)
    if choices is not None:
        if value in choices or value in DEPRECATED_VALUES.get(path, {}):  # the section renames an old value
            return value
        raise _FieldError(path, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
    if typing.get_origin(annotation) is tuple:
        return _coerce_tuple(value, typing.get_args(annotation), path, source)
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if annotation in (int, str, bool) and type(value) is annotation:
        return value
    raise _FieldError(path, f"expected {getattr(annotation, '__name__', annotation)}, got {value!r}")


def _coerce_tuple(value: Any, item_types: tuple, path: str, source: str) -> tuple:
    """A list as the tuple ``tuple[item_types]`` (``(X, ...)`` or fixed), each item coerced: ``[[boxed, 1]]`` ->
    ``(("boxed", 1.0),)`` for ``reward.mix``."""
    if not isinstance(value, list | tuple):
        raise _FieldError(path, f"expected a list, got {value!r}")
    if len(item_types) == 2 and item_types[1] is Ellipsis:
        item_types = (item_types[0],) * len(value)
    elif len(value) != len(item_types):
        raise _FieldError(path, f"expected a list of {len(item_types)} items, got {value!r}")
    return tuple(_coerce(item, item_type, path, source) for item, item_type in zip(value, item_types, strict=True))


def load_config_file(path: str | Path, base: RLConfig | None = None) -> RLConfig:
    """``base`` (default: the defaults) with every field the file sets; validated."""
    config = apply_fields(base or RLConfig(), flatten(read_config_file(path)), str(path))
    try:
        return config.validate()
    except ConfigError as error:
        raise ConfigFileError(f"{path}: {error.field_path}: {error.message}") from None
