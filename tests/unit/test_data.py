"""Prompt datasets: validated jsonl loading, encoding with the embedded tokenizer, and the episode schedule.

Other formats and column mapping: ``test_data_sources.py``."""

import json

import pytest
from transformers import AutoTokenizer

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.data import (
    DataError,
    build_messages,
    encode_prompt,
    load_prompt_dataset,
)
from colossal_rl.data_sources import load_prompt_rows
from colossal_rl.schedule.prompts import EpisodeSchedule


def row(content: str, answer: str = "0") -> dict:
    return {"messages": {"role": "user", "content": content}, "gt_answer": answer}


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))


# --- load_prompt_rows --------------------------------------------------------------------------------------


def test_rows_are_returned_in_file_order_skipping_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [row("1+1=?", "2"), "", "   ", row("2+2=?", "4")])
    assert load_prompt_rows(path) == [row("1+1=?", "2"), row("2+2=?", "4")]


def test_messages_as_a_list_are_accepted(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1=?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages, "gt_answer": "2"}])
    assert load_prompt_rows(path)[0]["messages"] == messages


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="dataset file not found: .*nope.jsonl"):
        load_prompt_rows(tmp_path / "nope.jsonl")


def test_a_directory_that_is_not_a_saved_dataset(tmp_path):
    with pytest.raises(DataError, match="not a dataset saved with datasets' save_to_disk"):
        load_prompt_rows(tmp_path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match="dataset file is empty"):
        load_prompt_rows(path)


def test_invalid_json_names_path_and_line(tmp_path):
    # Line numbers count blank lines too, so they match what an editor shows.
    path = write_jsonl(tmp_path / "d.jsonl", [row("1+1=?"), "", '{"messages": '])
    with pytest.raises(DataError) as caught:
        load_prompt_rows(path)
    assert str(caught.value).startswith(f"{path}:3: invalid JSON")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ({"gt_answer": "2"}, "missing key 'messages'"),
        ('["not", "an", "object"]', "expected a JSON object, got list"),
        ({"messages": []}, "'messages' must be a string, a message object or a non-empty list of them"),
        ({"messages": 3}, "'messages' must be a string, a message object or a non-empty list of them"),
        ({"messages": {"role": "user"}}, "every message needs a 'role' and a string 'content'"),
        ({"messages": {"content": "1+1=?"}}, "every message needs a 'role' and a string 'content'"),
        ({"messages": [{"role": "user", "content": 3}]}, "every message needs a 'role' and a string 'content'"),
    ],
)
def test_malformed_rows_name_path_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [row("1+1=?"), bad_line])
    with pytest.raises(DataError) as caught:
        load_prompt_rows(path)
    assert str(caught.value) == f"{path}:2: {message}"


# --- load_prompt_dataset -----------------------------------------------------------------------------------


def test_prompts_are_encoded_with_the_chat_template(tmp_path, tokenizer):
    rows = [row("1+1=?"), {"messages": [{"role": "user", "content": "23+1=?"}], "gt_answer": "24"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = load_prompt_dataset(path, tokenizer, system_prompt=None, max_prompt_tokens=512)
    assert len(dataset) == 2 and dataset.rows == rows and dataset.path == path
    for data_row, ids in zip(rows, dataset.prompt_ids, strict=True):
        assert ids == encode_prompt(tokenizer, build_messages(data_row["messages"], None))
    assert "1+1=?" in tokenizer.decode(dataset.prompt_ids[0])
    assert "23+1=?" in tokenizer.decode(dataset.prompt_ids[1])


def test_system_prompt_replaces_the_rows_own(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "Ignore me."}, {"role": "user", "content": "1+1=?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    dataset = load_prompt_dataset(path, tokenizer, system_prompt="Think.", max_prompt_tokens=512)
    text = tokenizer.decode(dataset.prompt_ids[0])
    assert "Think." in text and "Ignore me." not in text and "1+1=?" in text


def test_too_long_prompts_are_left_out_and_counted(tmp_path, tokenizer, caplog):
    short, long = row("1+1=?"), row("what is " + "1+" * 40 + "1?")
    short_length = len(encode_prompt(tokenizer, build_messages(short["messages"], None)))
    long_length = len(encode_prompt(tokenizer, build_messages(long["messages"], None)))
    assert long_length > short_length
    path = write_jsonl(tmp_path / "d.jsonl", [short, long, short])

    dataset = load_prompt_dataset(path, tokenizer, system_prompt=None, max_prompt_tokens=short_length)
    assert dataset.rows == [short, short] and dataset.dropped_overlong == 1
    assert (
        f"{path}: left out 1 of 3 prompts longer than -mpt/--max-prompt-tokens = {short_length} tokens" in caplog.text
    )
    # The limit itself is allowed.
    assert len(load_prompt_dataset(path, tokenizer, system_prompt=None, max_prompt_tokens=long_length)) == 3


def test_no_prompt_short_enough_is_an_error_naming_the_flag(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [row("1+1=?"), row("2+2=?")])
    with pytest.raises(DataError) as caught:
        load_prompt_dataset(path, tokenizer, system_prompt=None, max_prompt_tokens=3)
    assert str(caught.value) == f"{path}: all 2 prompts are longer than -mpt/--max-prompt-tokens = 3 tokens"


# --- EpisodeSchedule ---------------------------------------------------------------------------------------


def schedule(seed: int = 7) -> EpisodeSchedule:
    return EpisodeSchedule(num_rows=23, num_producers=2, prompts_per_producer=5, seed=seed)


def episode_slices(plan: EpisodeSchedule, episode: int) -> list[list[int]]:
    first = episode * plan.rounds_per_episode
    return [
        plan.rows_for(first + round_in_episode, producer)
        for round_in_episode in range(plan.rounds_per_episode)
        for producer in range(plan.num_producers)
    ]


def test_shape_of_an_episode():
    plan = schedule()
    assert (plan.rows_per_round, plan.rounds_per_episode, plan.unused_rows_per_episode()) == (10, 2, 3)
    assert EpisodeSchedule(num_rows=20, num_producers=2, prompts_per_producer=5, seed=0).unused_rows_per_episode() == 0


@pytest.mark.parametrize("episode", [0, 1, 4])
def test_within_an_episode_rows_are_used_once_and_producer_slices_are_disjoint(episode):
    plan = schedule()
    slices = episode_slices(plan, episode)
    assert all(len(rows) == plan.prompts_per_producer for rows in slices)
    used = [index for rows in slices for index in rows]
    assert len(used) == len(set(used)) == plan.num_rows - plan.unused_rows_per_episode()
    assert set(used) <= set(range(plan.num_rows))


def test_rows_for_is_a_pure_function():
    first, second = schedule(), schedule()
    for global_round in range(6):
        for producer in range(2):
            assert first.rows_for(global_round, producer) == second.rows_for(global_round, producer)
            assert first.rows_for(global_round, producer) == first.rows_for(global_round, producer)


def test_episodes_and_seeds_give_different_orders():
    plan = schedule()
    assert episode_slices(plan, 0) != episode_slices(plan, 1)
    assert episode_slices(plan, 0) != episode_slices(schedule(seed=8), 0)
    # Over several episodes the skipped rows change, so every row gets used.
    used = {index for episode in range(6) for rows in episode_slices(plan, episode) for index in rows}
    assert used == set(range(plan.num_rows))
