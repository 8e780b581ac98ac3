"""Where prompt rows come from, and how other datasets' columns map onto ours.

A source (``-d``, ``-ed``) is one of

    prompts.jsonl            one JSON object a line (errors name file:line)
    prompts.json             a JSON list of objects
    prompts.parquet          a parquet file (through ``datasets``)
    saved_dir[@split]        a directory written by ``datasets``' ``save_to_disk`` (a DatasetDict needs the split;
                             default ``train``)
    org/name[@split]         a Hugging Face hub dataset through ``datasets.load_dataset`` (default split ``train``;
                             needs the network or the local datasets cache)

Every row becomes ColossalChat's math format: ``messages`` from ``--prompt-key`` (a string becomes one user
message; a message object or a list of them is kept) and ``gt_answer`` from ``--answer-key``; other columns
(``test_cases``, ``fn_name``...) pass through. Rows lacking what the reward needs (``gt_answer`` for the math
rewards, ``test_cases`` for code; nothing for a ``--reward-fn`` plug-in) are an error naming the row.
Only jsonl and json are read without ``datasets`` (so the driver's check of the default run stays light).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colossal_rl.config import RLConfig

SPLIT_SEPARATOR = "@"
DEFAULT_SPLIT = "train"
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")


class DataError(ValueError):
    """A dataset is missing, empty or malformed; the message names the source (and row)."""


@dataclass(frozen=True)
class RowKeys:
    """Which columns hold the prompt and the answer, and which field the reward needs (None: none)."""

    prompt_key: str = "messages"
    answer_key: str = "gt_answer"
    required_field: str | None = None

    @staticmethod
    def required_for_reward(reward_type: str, reward_fn: str | None) -> str | None:
        if reward_fn is not None or reward_type in ("model", "judge"):
            return None  # a plug-in reads whatever it reads; a judge's {reference} is checked per sample
        return "test_cases" if reward_type == "code" else "gt_answer"

    @classmethod
    def for_config(cls, config: RLConfig) -> RowKeys:
        reward = config.reward
        return cls(
            prompt_key=config.data.prompt_key,
            answer_key=config.data.answer_key,
            required_field=cls.required_for_reward(reward.reward_type, reward.reward_fn),
        )


def split_source(source: str) -> tuple[str, str | None]:
    """``location@split`` -> (location, split); a path that exists with an ``@`` in it is taken whole."""
    if SPLIT_SEPARATOR in source and not Path(source).exists():
        location, split = source.rsplit(SPLIT_SEPARATOR, 1)
        if location and split:
            return location, split
    return source, None


def read_raw_rows(source: str) -> list[tuple[str, Any]]:
    """(where, row) for every row of ``source``, unvalidated; ``where`` names the file and line or row."""
    location, split = split_source(source)
    path = Path(location).expanduser()
    if path.is_dir():
        return _saved_dataset_rows(path, split)
    if path.is_file():
        if split is not None:
            raise DataError(
                f"{source}: @{split} selects a split of a saved dataset directory or hub dataset, not of a file"
            )
        suffix = path.suffix.lower()
        if suffix in JSON_LINES_SUFFIXES:
            return _json_lines_rows(path)
        if suffix == ".json":
            return _json_rows(path)
        if suffix == ".parquet":
            return _parquet_rows(path)
        raise DataError(
            f"{path}: unknown dataset format {suffix!r} (jsonl, json, parquet or a saved dataset directory)"
        )
    if path.suffix.lower() in (*JSON_LINES_SUFFIXES, ".json", ".parquet") or location.startswith((".", "/", "~")):
        raise DataError(f"dataset file not found: {path}")
    return _hub_rows(location, split)


def _json_lines_rows(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{line_number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: invalid JSON ({error.msg} at column {error.colno})") from None
    return rows


def _json_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must be a list of row objects (jsonl: one object a line)")
    return [(f"{path}: row {index + 1}", row) for index, row in enumerate(data)]


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    import datasets

    try:
        table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as error:  # pyarrow's errors vary by what is wrong with the file
        raise DataError(f"{path}: unreadable parquet file ({error})") from None
    return [(f"{path}: row {index + 1}", row) for index, row in enumerate(table.to_list())]


def _saved_dataset_rows(path: Path, split: str | None) -> list[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as error:  # not a save_to_disk directory
        raise DataError(f"{path}: not a dataset saved with datasets' save_to_disk ({error})") from None
    return _dataset_rows(loaded, split, str(path))


def _hub_rows(name: str, split: str | None) -> list[tuple[str, Any]]:
    """From the local datasets cache if it holds the dataset, else from the hub if reachable (checked in a few
    seconds, where the hub client would retry for half a minute); one line naming the dataset otherwise."""
    import datasets

    chosen = split or DEFAULT_SPLIT
    where = f"dataset {name!r} (split {chosen}) is not a local file or directory"
    offline = datasets.config.HF_HUB_OFFLINE
    try:
        datasets.config.HF_HUB_OFFLINE = True
        return _dataset_rows(datasets.load_dataset(name, split=chosen), None, f"{name}@{chosen}")
    except DataError:
        raise
    except Exception:  # not in the cache: try the hub
        pass
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    if offline or not hub_reachable():
        raise DataError(f"{where}, not in the local datasets cache, and the Hugging Face hub is not reachable")
    try:
        loaded = datasets.load_dataset(name, split=chosen)
    except Exception as error:  # unknown name or split: one line naming the dataset
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{where} and could not be loaded from the Hugging Face hub: {message}") from None
    return _dataset_rows(loaded, None, f"{name}@{chosen}")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``) accepts a TCP connection within ``timeout_s``."""
    import os
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _dataset_rows(loaded: Any, split: str | None, label: str) -> list[tuple[str, Any]]:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        chosen = split or DEFAULT_SPLIT
        if chosen not in loaded:
            raise DataError(f"{label}: no split {chosen!r} (splits: {', '.join(loaded)}); name one as {label}@<split>")
        loaded, label = loaded[chosen], f"{label}@{chosen}"
    elif split is not None:
        raise DataError(f"{label}: holds a single dataset, not splits; drop @{split}")
    return [(f"{label}: row {index + 1}", row) for index, row in enumerate(loaded.to_list())]


def normalise_row(row: Any, where: str, keys: RowKeys) -> dict[str, Any]:
    """One row in ColossalChat's math format (see the module docstring); errors name ``where``."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if keys.prompt_key not in row:
        flag = "" if keys.prompt_key == "messages" else " (--prompt-key)"
        raise DataError(f"{where}: missing key {keys.prompt_key!r}{flag}")
    prompt = row[keys.prompt_key]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    message_list = [messages] if isinstance(messages, dict) else messages
    if not isinstance(message_list, list) or not message_list:
        raise DataError(f"{where}: {keys.prompt_key!r} must be a string, a message object or a non-empty list of them")
    for message in message_list:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) or "role" not in message:
            raise DataError(f"{where}: every message needs a 'role' and a string 'content'")
    normalised = {**row, "messages": messages}
    if keys.answer_key in row:
        normalised["gt_answer"] = row[keys.answer_key]
    if keys.required_field is not None and normalised.get(keys.required_field) in (None, ""):
        source_key = keys.answer_key if keys.required_field == "gt_answer" else keys.required_field
        flag = " (--answer-key)" if keys.required_field == "gt_answer" else ""
        raise DataError(f"{where}: no {source_key!r}{flag}, which the reward needs to score this prompt")
    return normalised


def load_prompt_rows(source: str | Path, keys: RowKeys | None = None) -> list[dict[str, Any]]:
    """Every row of ``source`` in ColossalChat's format, validated; an empty source is an error."""
    keys = keys or RowKeys()
    rows = [normalise_row(row, where, keys) for where, row in read_raw_rows(str(source))]
    if not rows:
        raise DataError(f"dataset file is empty: {source}")
    return rows
