"""Environments by name (``--env calculator``) and user plug-ins (``--env path/to/file.py:Class``).

A name maps to a factory ``(EnvironmentContext) -> Environment``; a plug-in class is its own factory (its
constructor takes the context, or nothing). :func:`check_environment` loads a spec and opens one episode on a
training row, before Ray starts, so a typo or a broken plug-in fails the launch in seconds with a message naming
the file. Importing this module imports neither torch nor the sandbox.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from colossal_rl.algorithms.registry import Registry
from colossal_rl.environments.base import Environment, EnvironmentContext
from colossal_rl.reward.plugin_specs import load_spec

EnvironmentFactory = Callable[[EnvironmentContext], Environment]
ENVIRONMENTS: Registry[EnvironmentFactory] = Registry("environment")
DEFAULT_ENVIRONMENT = "single_turn"


class EnvironmentConfigError(ValueError):
    """An ``--env`` spec that does not name a usable environment; the message names the spec and file."""


@ENVIRONMENTS.register("single_turn")
def _single_turn(context: EnvironmentContext) -> Environment:
    from colossal_rl.environments.scored import SingleTurnEnvironment

    return SingleTurnEnvironment(context)


@ENVIRONMENTS.register("calculator")
def _calculator(context: EnvironmentContext) -> Environment:
    from colossal_rl.environments.calculator import CalculatorEnvironment

    return CalculatorEnvironment(context)


@ENVIRONMENTS.register("python")
def _python(context: EnvironmentContext) -> Environment:
    from colossal_rl.environments.python_tool import PythonEnvironment

    return PythonEnvironment(context)


def is_plugin_spec(spec: str) -> bool:
    return ":" in spec


def environment_factory(spec: str) -> EnvironmentFactory:
    """The factory of a registered name or of a plug-in ``file.py:Class`` / ``module:Class``."""
    if not is_plugin_spec(spec):
        try:
            return ENVIRONMENTS.get(spec)
        except ValueError as error:
            raise EnvironmentConfigError(f"--env: {error}; or a plug-in path/to/file.py:Class") from None
    return _plugin_factory(spec, load_environment_class(spec))


def load_environment_class(spec: str) -> type:
    """The class ``spec`` names, checked to have ``reset`` and ``step`` and a constructor taking (context) or ()."""
    location, attribute, cls = load_spec(
        spec, label="--env", kind="Class", module_prefix="colossal_rl_user_env", error=EnvironmentConfigError
    )
    if not inspect.isclass(cls):
        found = "nothing" if cls is None else f"a {type(cls).__name__}"
        raise EnvironmentConfigError(f"--env {spec!r}: {location} has {found} named {attribute!r}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise EnvironmentConfigError(f"--env {spec!r}: class {attribute} has no method(s) {', '.join(missing)}")
    _takes_context(spec, cls)
    return cls


def _takes_context(spec: str, cls: type) -> bool:
    signature = inspect.signature(cls)
    for arguments in (("context",), ()):
        try:
            signature.bind(*arguments)
            return bool(arguments)
        except TypeError:
            continue
    raise EnvironmentConfigError(f"--env {spec!r}: {cls.__name__}{signature} must take (context) or no arguments")


def _plugin_factory(spec: str, cls: type) -> EnvironmentFactory:
    if _takes_context(spec, cls):
        return lambda context: cls(context)
    return lambda context: cls()


def check_environment(spec: str, row: dict[str, Any], context: EnvironmentContext) -> None:
    """Make the environment and open an episode on ``row``: its first messages must be chat messages."""
    factory = environment_factory(spec)
    try:
        environment = factory(context)
    except Exception as error:  # the user's constructor, named in one line
        raise EnvironmentConfigError(f"--env {spec!r}: making it raised {type(error).__name__}: {error}") from None
    try:
        messages = environment.reset(row)
    except Exception as error:
        raise EnvironmentConfigError(
            f"--env {spec!r}: reset(first row) raised {type(error).__name__}: {error}"
        ) from None
    finally:
        close = getattr(environment, "close", None)
        if callable(close):
            close()
    bad = [m for m in messages or [] if not (isinstance(m, dict) and "role" in m and "content" in m)]
    if not messages or bad:
        raise EnvironmentConfigError(
            f"--env {spec!r}: reset(first row) must return a non-empty list of {{'role', 'content'}} messages, "
            f"got {messages!r:.200}"
        )
