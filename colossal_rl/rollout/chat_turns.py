"""Chat messages -> token ids for multi-turn rollouts: the first prompt (with the tools) and each observation.

An observation (tool results, feedback) is rendered the way the model's chat template renders those messages
after an assistant turn, and tokenised once: we render a fixed placeholder conversation with and without the
observation and keep the difference, prefixed by what the template puts after an assistant's message (its end
of turn, e.g. ``<|im_end|>\\n``) minus the end-of-turn token the policy already sampled. So the sampled ids stay
exactly as sampled and the whole sequence is what the template would give the finished conversation.

Templates that render ``tool`` messages (Qwen2.5, Qwen3) are used as they are. Otherwise (the embedded tiny
model's template refuses the ``tool`` role) tool results go into one ``user`` message as
``<tool_response>\\n...\\n</tool_response>``, which is what Qwen's template does itself; without any chat
template that text is used raw. Tools reach the first prompt through ``apply_chat_template(tools=...)`` when
the template renders them, else as Qwen's tool description appended to the system message.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from colossal_rl.environments.base import Message
from colossal_rl.environments.tool_calls import Tool, tools_system_text

logger = logging.getLogger(__name__)

_QUESTION, _ANSWER, _PROBE = "\x00question\x00", "\x00answer\x00", "\x00probe\x00"


def _render(tokenizer, messages: list[Message], *, generation_prompt: bool, tools=None) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(token) for token in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]


class ChatTurns:
    """Renders one tokenizer's prompts and observations (built once per producer; probes the template)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.tool_role = self.has_template and self._renders([{"role": "tool", "name": "t", "content": _PROBE}])
        self.template_tools = self.has_template and self._renders_tools()
        self._base = [{"role": "user", "content": _QUESTION}, {"role": "assistant", "content": _ANSWER}]
        self._after_answer = self._after_assistant() if self.has_template else ""
        self._special_ids = set(getattr(tokenizer, "all_special_ids", []))
        logger.info("multi-turn chat: tool role %s, template tools %s", self.tool_role, self.template_tools)

    def _renders(self, observation: list[Message]) -> bool:
        base = [{"role": "user", "content": _QUESTION}, {"role": "assistant", "content": _ANSWER}]
        try:
            return _PROBE in _render(self.tokenizer, base + observation, generation_prompt=True)
        except Exception:  # jinja's raise_exception, or a template that cannot take the message
            return False

    def _renders_tools(self) -> bool:
        probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}]
        try:
            return _PROBE in _render(
                self.tokenizer, [{"role": "user", "content": "x"}], generation_prompt=True, tools=probe
            )
        except Exception:
            return False

    def _after_assistant(self) -> str:
        """What the template writes after an assistant message's content (its end of turn)."""
        text = _render(self.tokenizer, self._base, generation_prompt=False)
        return text[text.rindex(_ANSWER) + len(_ANSWER) :]

    def prompt_ids(self, messages: list[Message], tools: Sequence[Tool] = ()) -> list[int]:
        """The first prompt: ``messages`` with the tools, ending with the assistant's generation prompt."""
        if tools and not self.template_tools:
            messages = with_tools_in_system(messages, tools)
        if not self.has_template:
            return _encode(self.tokenizer, "\n".join(m["content"] for m in messages) + "\n")
        schemas = [tool.schema() for tool in tools] if tools and self.template_tools else None
        return _encode(self.tokenizer, _render(self.tokenizer, messages, generation_prompt=True, tools=schemas))

    def observation_ids(self, observation: Sequence[Message], last_sampled_id: int | None) -> list[int]:
        """Token ids of ``observation`` following a policy turn whose last sampled token is ``last_sampled_id``,
        through the next assistant generation prompt."""
        return _encode(self.tokenizer, self.observation_text(observation, last_sampled_id))

    def observation_text(self, observation: Sequence[Message], last_sampled_id: int | None) -> str:
        messages = list(observation) if self.tool_role else tool_results_as_user(observation)
        if not self.has_template:
            return "".join(m["content"] for m in messages) + "\n"
        before = _render(self.tokenizer, self._base, generation_prompt=False)
        after = _render(self.tokenizer, self._base + messages, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template renders earlier messages differently once more follow")
        ending = self._after_answer
        if last_sampled_id is not None and last_sampled_id in self._special_ids:
            sampled = self.tokenizer.decode([last_sampled_id])
            ending = ending.removeprefix(sampled) if ending.startswith(sampled) else ending
        return ending + after[len(before) :]


def tool_results_as_user(observation: Sequence[Message]) -> list[Message]:
    """Consecutive ``tool`` messages as one ``user`` message of ``<tool_response>`` blocks (Qwen's own form)."""
    messages: list[Message] = []
    for message in observation:
        if message["role"] != "tool":
            messages.append(dict(message))
            continue
        block = f"<tool_response>\n{message['content']}\n</tool_response>"
        if messages and messages[-1].get("_tool_results"):
            messages[-1]["content"] += "\n" + block
        else:
            messages.append({"role": "user", "content": block, "_tool_results": True})
    return [{key: value for key, value in m.items() if key != "_tool_results"} for m in messages]


def with_tools_in_system(messages: list[Message], tools: Sequence[Tool]) -> list[Message]:
    """``messages`` with Qwen's tool description appended to the system message (one is added if none)."""
    text = tools_system_text(list(tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def episode_tools(environment: Any) -> tuple[Tool, ...]:
    """The tools an environment offers (its optional ``tools`` attribute)."""
    return tuple(getattr(environment, "tools", ()) or ())
