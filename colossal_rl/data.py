"""Prompt datasets: loading jsonl rows and turning them into model token ids.

Rows follow ColossalChat's math format ``{"messages": {"role": "user", "content": ...}, "gt_answer": ...}``
(``messages`` may also be a list of such dicts). Every prompt is encoded through
:func:`encode_prompt` — the one path the producers, the evaluator and the embedded
model's pre-training all share, so the model always sees the token sequence it was trained on.
"""

from __future__ import annotations

from typing import Any


def build_messages(row_messages: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """Chat messages for one row: the system prompt (if any) followed by the row's messages."""
    messages = [row_messages] if isinstance(row_messages, dict) else list(row_messages)
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m.get("role") != "system"]
    return messages


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant turn's opening (the generation prompt)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
