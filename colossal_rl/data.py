"""Prompt datasets: loading jsonl rows and turning them into model token ids.

Rows follow ColossalChat's math format ``{"messages": {"role": "user", "content": ...}, "gt_answer": ...}``
(``messages`` may also be a list of such dicts). Every prompt is encoded through
:func:`encode_prompt` — the one path the producers, the evaluator and the embedded
model's pre-training all share, so the model always sees the token sequence it was trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
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


class DataError(ValueError):
    """A dataset file is missing, empty or malformed; the message names the file (and line)."""


def load_jsonl_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a prompt jsonl file, validated: each has ``messages`` (a dict or a list of dicts with content)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: invalid JSON ({error.msg} at column {error.colno})") from None
            _check_row(row, path, line_number)
            rows.append(row)
    if not rows:
        raise DataError(f"dataset file is empty: {path}")
    return rows


def _check_row(row: Any, path: Path, line_number: int) -> None:
    where = f"{path}:{line_number}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" not in row:
        raise DataError(f"{where}: missing key 'messages'")
    messages = row["messages"]
    message_list = [messages] if isinstance(messages, dict) else messages
    if not isinstance(message_list, list) or not message_list:
        raise DataError(f"{where}: 'messages' must be a message object or a non-empty list of them")
    for message in message_list:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) or "role" not in message:
            raise DataError(f"{where}: every message needs a 'role' and a string 'content'")


@dataclass(frozen=True)
class PromptDataset:
    """Rows of one jsonl file with their encoded prompts (``prompt_ids[i]`` belongs to ``rows[i]``)."""

    path: str
    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


def load_prompt_dataset(
    path: str | Path, tokenizer, system_prompt: str | None, max_prompt_tokens: int
) -> PromptDataset:
    """Load and encode a prompt file; a prompt longer than ``max_prompt_tokens`` is an error naming its line."""
    rows = load_jsonl_rows(path)
    prompt_ids = []
    for index, row in enumerate(rows):
        ids = encode_prompt(tokenizer, build_messages(row["messages"], system_prompt))
        if len(ids) > max_prompt_tokens:
            raise DataError(
                f"{path}: row {index + 1} has {len(ids)} prompt tokens, more than -mpt/--max-prompt-tokens "
                f"= {max_prompt_tokens}"
            )
        prompt_ids.append(ids)
    return PromptDataset(path=str(path), rows=rows, prompt_ids=prompt_ids)


@dataclass(frozen=True)
class EpisodeSchedule:
    """Which dataset rows producer ``p`` generates in round ``r``: a pure function of (seed, episode, round, p).

    Each episode is one seeded permutation of the rows; round ``r`` of an episode takes the next
    ``num_producers * prompts_per_producer`` rows of it, producer ``p`` its own contiguous slice.
    The last ``num_rows % rows_per_round`` rows of each permutation are not used in that episode
    (reported by :meth:`unused_rows_per_episode`); a new permutation each episode means no row is
    skipped systematically. Being pure, it makes resume exact: no sampler state to save.
    """

    num_rows: int
    num_producers: int
    prompts_per_producer: int
    seed: int

    @property
    def rows_per_round(self) -> int:
        return self.num_producers * self.prompts_per_producer

    @property
    def rounds_per_episode(self) -> int:
        return self.num_rows // self.rows_per_round

    def unused_rows_per_episode(self) -> int:
        return self.num_rows - self.rounds_per_episode * self.rows_per_round

    def rows_for(self, global_round: int, producer_rank: int) -> list[int]:
        episode, round_in_episode = divmod(global_round, self.rounds_per_episode)
        import torch  # here, not at import: the driver reads datasets and counts rounds without torch

        generator = torch.Generator().manual_seed(self.seed + episode)
        order = torch.randperm(self.num_rows, generator=generator)
        start = round_in_episode * self.rows_per_round + producer_rank * self.prompts_per_producer
        return order[start : start + self.prompts_per_producer].tolist()
