"""Prompt sources: jsonl, json, parquet, saved datasets directories (with splits), the hub offline; column mapping;
rows lacking what the reward needs. All offline."""

from __future__ import annotations

import json
import time

import datasets
import pytest

from colossal_rl.data_sources import DataError, RowKeys, load_prompt_rows, split_source

MATH_ROWS = [
    {"problem": "1+1=?", "solution": "2", "level": 1},
    {"problem": "2+3=?", "solution": "5", "level": 2},
]
EXPECTED = [
    {**row, "messages": [{"role": "user", "content": row["problem"]}], "gt_answer": row["solution"]}
    for row in MATH_ROWS
]
MATH_KEYS = RowKeys(prompt_key="problem", answer_key="solution", required_field="gt_answer")


def _write(tmp_path, fmt: str) -> str:
    """MATH_ROWS in ``fmt``; the path to give as a source."""
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in MATH_ROWS))
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(MATH_ROWS))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(MATH_ROWS).to_parquet(str(path))
    elif fmt == "saved":
        path = tmp_path / "saved"
        datasets.Dataset.from_list(MATH_ROWS).save_to_disk(str(path))
    elif fmt == "saved_splits":
        path = tmp_path / "saved_splits"
        other = [{"problem": "9+9=?", "solution": "18", "level": 3}]
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(MATH_ROWS), "test": datasets.Dataset.from_list(other)}
        ).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "saved", "saved_splits"])
def test_every_local_format_gives_the_same_rows_with_mapped_columns(tmp_path, fmt):
    assert load_prompt_rows(_write(tmp_path, fmt), MATH_KEYS) == EXPECTED


def test_a_split_of_a_saved_dataset_dict_is_chosen_with_at(tmp_path):
    source = _write(tmp_path, "saved_splits")
    (row,) = load_prompt_rows(source + "@test", MATH_KEYS)
    assert row["messages"] == [{"role": "user", "content": "9+9=?"}] and row["gt_answer"] == "18"
    with pytest.raises(DataError, match=r"no split 'validation' \(splits: train, test\)"):
        load_prompt_rows(source + "@validation", MATH_KEYS)


def test_a_split_on_a_file_or_a_single_dataset_is_refused(tmp_path):
    with pytest.raises(DataError, match="selects a split of a saved dataset directory"):
        load_prompt_rows(_write(tmp_path, "jsonl") + "@train", MATH_KEYS)
    with pytest.raises(DataError, match="holds a single dataset, not splits; drop @train"):
        load_prompt_rows(_write(tmp_path, "saved") + "@train", MATH_KEYS)


def test_split_source_keeps_an_existing_path_with_an_at_sign(tmp_path):
    odd = tmp_path / "a@b.jsonl"
    odd.write_text(json.dumps({"messages": {"role": "user", "content": "x"}}) + "\n")
    assert split_source(str(odd)) == (str(odd), None)
    assert split_source("org/name@test") == ("org/name", "test")
    assert split_source("org/name") == ("org/name", None)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_a_row_without_the_answer_the_reward_needs_names_its_row(tmp_path, fmt):
    rows = [MATH_ROWS[0], {"problem": "3+3=?", "level": 1}]
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        where = f"{path}:2"
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
        where = f"{path}: row 2"
    else:
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        where = f"{path}: row 2"
    with pytest.raises(DataError) as caught:
        load_prompt_rows(str(path), MATH_KEYS)
    message = str(caught.value)
    assert message.startswith(where) and "no 'solution' (--answer-key)" in message


def test_what_each_reward_needs():
    assert RowKeys.required_for_reward("boxed", None) == "gt_answer"
    assert RowKeys.required_for_reward("think_answer_tags", None) == "gt_answer"
    assert RowKeys.required_for_reward("code", None) == "test_cases"
    assert RowKeys.required_for_reward("boxed", "my_reward.py:score") is None  # a plug-in reads what it reads


def test_code_rows_need_test_cases_and_plugins_need_nothing(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"messages": {"role": "user", "content": "Write f."}}) + "\n")
    with pytest.raises(DataError, match=r"code.jsonl:1: no 'test_cases'"):
        load_prompt_rows(str(path), RowKeys(required_field="test_cases"))
    (row,) = load_prompt_rows(str(path), RowKeys(required_field=None))
    assert "gt_answer" not in row


def test_a_missing_prompt_column_names_the_flag(tmp_path):
    with pytest.raises(DataError, match=r"d.jsonl:1: missing key 'question' \(--prompt-key\)"):
        load_prompt_rows(_write(tmp_path, "jsonl"), RowKeys(prompt_key="question"))


def test_bad_local_sources_name_themselves(tmp_path):
    with pytest.raises(DataError, match="dataset file not found: .*nope.parquet"):
        load_prompt_rows(str(tmp_path / "nope.parquet"))
    bad = tmp_path / "d.csv"
    bad.write_text("a,b\n")
    with pytest.raises(DataError, match="unknown dataset format '.csv'"):
        load_prompt_rows(str(bad))
    not_a_list = tmp_path / "d.json"
    not_a_list.write_text('{"messages": "x"}')
    with pytest.raises(DataError, match="must be a list of row objects"):
        load_prompt_rows(str(not_a_list))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="unreadable parquet file"):
        load_prompt_rows(str(broken))


def test_a_hub_name_offline_fails_fast_naming_the_dataset(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the hub is unreachable here
    started = time.monotonic()
    with pytest.raises(DataError) as caught:
        load_prompt_rows("no-such-org/no-such-dataset@test")
    assert time.monotonic() - started < 10
    assert str(caught.value) == (
        "dataset 'no-such-org/no-such-dataset' (split test) is not a local file or directory, not in the local "
        "datasets cache, and the Hugging Face hub is not reachable"
    )
