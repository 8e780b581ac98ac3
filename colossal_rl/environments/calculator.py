"""A calculator tool: arithmetic on numbers, evaluated by walking the expression's syntax tree (no ``eval``).

Only number literals, ``+ - * / // % **``, unary signs and parentheses are accepted; names, calls, attributes,
strings and everything else are refused. Sizes are bounded before any big operation runs (expression length,
tree size, integer bits, exponents), so no input can make it slow or big.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from colossal_rl.environments.base import EnvironmentContext
from colossal_rl.environments.scored import ToolEnvironment
from colossal_rl.environments.tool_calls import Tool, ToolError

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 100
MAX_INT_BITS = 256
"""Integers (operands and results) above 2**256 are refused."""
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ToolError):
    """The expression is not plain bounded arithmetic, or its value is undefined (division by zero)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; raises :class:`CalculatorError` with a reason otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {error.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"unsupported element {type(node).__name__}: only numbers and + - * / // % ** ( )")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if base.bit_length() * exponent > MAX_INT_BITS + 64:
            raise CalculatorError("result too large")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if isinstance(base, float | int) and base < 0 and not float(exponent).is_integer():
        raise CalculatorError("fractional power of a negative number")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    return value


def format_value(value: int | float) -> str:
    """Integers as they are; floats with up to 12 significant digits, integral floats without ``.0``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _calculate(arguments: dict[str, Any]) -> str:
    expression = arguments["expression"]
    if not isinstance(expression, str | int | float) or isinstance(expression, bool):
        raise CalculatorError("expression must be a string such as '12*(3+4)'")
    return format_value(evaluate(str(expression)))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns its value.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
        "required": ["expression"],
    },
    run=_calculate,
)


class CalculatorEnvironment(ToolEnvironment):
    """``--env calculator``: the policy may call the calculator, then answers; scored by the run's reward."""

    def __init__(self, context: EnvironmentContext):
        super().__init__(context, [CALCULATOR])
