"""Tool calls in Qwen's chat format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Parsing never raises: every ``<tool_call>`` block of a turn becomes either a :class:`ToolCall` or a
:class:`CallError` whose message the policy reads back in a ``<tool_response>``. :func:`run_calls` executes the
well-formed calls of a turn against the environment's :class:`Tool` s and turns each result or failure into a
``tool`` message. The tools' description for a system prompt follows Qwen2.5's template (``tools_system_text``),
for tokenizers whose chat template does not take ``tools=`` itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colossal_rl.environments.base import Message

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
MAX_CALLS_PER_TURN = 8
"""Calls past this many in one turn are answered with an error instead of being run."""
MAX_RESULT_CHARS = 2000
"""A tool's answer is cut to this many characters (the rest is replaced by a note)."""


class ToolError(Exception):
    """A tool could not do what was asked; its message is what the policy reads."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    """The tool asked for."""
    arguments: dict[str, Any]
    """Its arguments ({} when the call gave none)."""


@dataclass(frozen=True)
class CallError:
    message: str
    """Why the call cannot run (bad JSON, no name, ...), shown to the policy."""


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The turn's text outside its tool-call blocks, stripped."""
    calls: tuple[ToolCall | CallError, ...]
    """Every ``<tool_call>`` block, in order (an unterminated last block included, as an error)."""


def parse_tool_calls(text: str) -> ParsedTurn:
    """The tool calls in one policy turn, and the text around them."""
    calls: list[ToolCall | CallError] = [_parse_call(body) for body in _CALL.findall(text)]
    rest = _CALL.sub("", text)
    if _OPEN in rest:  # a block that never closed (the turn hit its token limit or the model forgot)
        calls.append(CallError("unterminated <tool_call>: close it with </tool_call>"))
        rest = rest[: rest.index(_OPEN)]
    return ParsedTurn(content=rest.strip(), calls=tuple(calls))


def _parse_call(body: str) -> ToolCall | CallError:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return CallError(f"invalid JSON in <tool_call>: {error.msg} at position {error.pos}")
    if not isinstance(value, dict):
        return CallError(f'a tool call is a JSON object {{"name": ..., "arguments": {{...}}}}, got {_kind(value)}')
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return CallError('a tool call needs "name" (a string)')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return CallError(f'"arguments" of {name} is a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return CallError(f'"arguments" of {name} must be a JSON object, got {_kind(arguments)}')
    return ToolCall(name=name, arguments=arguments)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments: ``{"type": "object", "properties": {...}, "required": [...]}``."""
    run: Callable[[dict[str, Any]], str]
    """The tool itself: arguments -> result text; raises :class:`ToolError` for a failure the policy should see."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema (what ``apply_chat_template(tools=...)`` takes)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why ``arguments`` do not fit the schema's names and required keys, or None."""
        known = self.parameters.get("properties", {})
        missing = [key for key in self.parameters.get("required", []) if key not in arguments]
        if missing:
            return f"{self.name}: missing argument(s) {', '.join(missing)}"
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            return f"{self.name}: unknown argument(s) {', '.join(unknown)}; it takes {', '.join(known) or 'none'}"
        return None


def run_calls(calls: tuple[ToolCall | CallError, ...], tools: dict[str, Tool]) -> tuple[list[Message], int]:
    """One ``tool`` message per call (its result or its error), and how many were errors."""
    messages, errors = [], 0
    for index, call in enumerate(calls):
        name, text, failed = _answer(call, tools, index)
        messages.append({"role": "tool", "name": name, "content": _cut(text)})
        errors += failed
    return messages, errors


def _answer(call: ToolCall | CallError, tools: dict[str, Tool], index: int) -> tuple[str, str, bool]:
    if index >= MAX_CALLS_PER_TURN:
        return "error", f"error: more than {MAX_CALLS_PER_TURN} tool calls in one turn; this one was not run", True
    if isinstance(call, CallError):
        return "error", f"error: {call.message}", True
    tool = tools.get(call.name)
    if tool is None:
        return call.name, f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", True
    problem = tool.check_arguments(call.arguments)
    if problem is not None:
        return call.name, f"error: {problem}", True
    try:
        return call.name, tool.run(call.arguments), False
    except ToolError as error:
        return call.name, f"error: {error}", True


def _cut(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[... {len(text) - MAX_RESULT_CHARS} more characters cut]"


def tools_system_text(tools: list[Tool]) -> str:
    """The tools' description Qwen2.5's chat template puts in the system message (for templates without tools)."""
    signatures = "\n".join(json.dumps(tool.schema(), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
