"""Prompt datasets: rows (from any source, see ``data_sources``) turned into model token ids.

Rows follow ColossalChat's math format ``{"messages": {"role": "user", "content": ...}, "gt_answer": ...}``
(``messages`` may also be a list of such dicts). Every prompt is encoded through
:func:`encode_prompt` — the one path the producers, the evaluator and the embedded
model's pre-training all share, so the model always sees the token sequence it was trained on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colossal_rl.data_sources import DataError, RowKeys, load_prompt_rows

logger = logging.getLogger(__name__)

__all__ = ["DataError", "EpisodeSchedule", "PromptDataset", "build_messages", "encode_prompt", "load_prompt_dataset"]


def build_messages(row_messages: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """Chat messages for one row: the system prompt (if any) followed by the row's messages."""
    messages = [row_messages] if isinstance(row_messages, dict) else list(row_messages)
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m.get("role") != "system"]
    return messages


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant turn's opening (the generation prompt)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@dataclass(frozen=True)
class PromptDataset:
    """Rows of one source with their encoded prompts (``prompt_ids[i]`` belongs to ``rows[i]``)."""

    path: str
    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    dropped_overlong: int = 0
    """Rows of the source left out for being longer than the prompt budget."""

    def __len__(self) -> int:
        return len(self.rows)


def load_prompt_dataset(
    source: str | Path, tokenizer, system_prompt: str | None, max_prompt_tokens: int, keys: RowKeys | None = None
) -> PromptDataset:
    """Load and encode a prompt source; prompts longer than ``max_prompt_tokens`` are left out and counted
    (logged), and a source with none short enough is an error."""
    rows, prompt_ids = [], []
    all_rows = load_prompt_rows(source, keys or RowKeys())
    for row in all_rows:
        ids = encode_prompt(tokenizer, build_messages(row["messages"], system_prompt))
        if len(ids) <= max_prompt_tokens:
            rows.append(row)
            prompt_ids.append(ids)
    dropped = len(all_rows) - len(rows)
    if not rows:
        raise DataError(
            f"{source}: all {len(all_rows)} prompts are longer than -mpt/--max-prompt-tokens = {max_prompt_tokens} tokens"
        )
    if dropped:
        logger.warning(
            "%s: left out %d of %d prompts longer than -mpt/--max-prompt-tokens = %d tokens",
            source,
            dropped,
            len(all_rows),
            max_prompt_tokens,
        )
    return PromptDataset(path=str(source), rows=rows, prompt_ids=prompt_ids, dropped_overlong=dropped)


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
