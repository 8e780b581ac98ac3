"""The reward-model scorer (``reward/reward_model.py``) on the real embedded tiny reward model
(``scripts/build_tiny_reward_model.py``: it prefers the correct ``\\boxed{}`` sum; built into a temporary directory
when the asset is absent)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from colossal_rl.config import ASSETS_DIR, EMBEDDED_EVAL_DATA
from colossal_rl.reward import OK, RewardConfigError
from colossal_rl.reward.reward_model import NORMALISATIONS, RewardModelConfig, RewardModelScorer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import build_tiny_reward_model as build  # noqa: E402

EMBEDDED_REWARD_MODEL_DIR = ASSETS_DIR / "tiny_reward_model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    if (EMBEDDED_REWARD_MODEL_DIR / "model.safetensors").exists():
        return EMBEDDED_REWARD_MODEL_DIR
    built = tmp_path_factory.mktemp("tiny_reward_model")
    build.build_reward_model(built)
    return built


@pytest.fixture(scope="module")
def scorer(model_dir) -> RewardModelScorer:
    scorer = RewardModelScorer(str(model_dir), RewardModelConfig(batch_size=4))
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def eval_rows() -> list[dict]:
    with open(EMBEDDED_EVAL_DATA, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle][:8]


def test_the_sample_is_rendered_through_the_models_chat_template(scorer, eval_rows):
    row = eval_rows[0]
    text = scorer.render("\\boxed{7}", row)
    assert text == f"<|user|>{row['messages']['content']}<|assistant|>\\boxed{{7}}<|endoftext|>"
    listed = {"messages": [{"role": "system", "content": "Be brief."}, row["messages"]]}
    assert scorer.render("x", listed).index("Be brief.") < scorer.render("x", listed).index("<|assistant|>x")


def test_a_tokenizer_without_a_chat_template_falls_back_to_role_lines(scorer, eval_rows):
    template, scorer.tokenizer.chat_template = scorer.tokenizer.chat_template, None
    try:
        text = scorer.render("\\boxed{7}", eval_rows[0])
    finally:
        scorer.tokenizer.chat_template = template
    assert text == f"User: {eval_rows[0]['messages']['content']}\n\nAssistant: \\boxed{{7}}"


def test_long_texts_keep_their_end(model_dir):
    scorer = RewardModelScorer(str(model_dir), RewardModelConfig(max_tokens=5))
    assert scorer.tokenizer.convert_ids_to_tokens(scorer.token_ids("<|user|>1+2=?<|assistant|>\\boxed{3}")) == list(
        "ed{3}"
    )


def test_batched_scores_equal_one_by_one_scores(scorer, eval_rows):
    texts = [scorer.render(response, row) for row in eval_rows for response in ("\\boxed{12}", "no", "\\boxed{1")]
    batched = scorer.score_texts(texts)
    single = [scorer.score_texts([text])[0] for text in texts]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), rtol=0, atol=1e-5)


def test_normalisations_map_the_raw_logit(scorer, eval_rows):
    responses = [f"\\boxed{{{row['gt_answer']}}}" for row in eval_rows] + ["", "7"]
    rows = eval_rows + eval_rows[:2]
    raw = scorer.score_texts([scorer.render(r, row) for r, row in zip(responses, rows, strict=True)])
    records = scorer.score_batch(responses, rows)
    assert [record.details["raw_score"] for record in records] == pytest.approx(raw, abs=1e-5)
    assert all(record.status == OK and 0 < record.reward < 1 for record in records)  # sigmoid, the default
    for record, logit in zip(records, raw, strict=True):
        assert record.reward == pytest.approx(1 / (1 + math.exp(-logit)))
        assert record.answer_ok == (logit > 0)
    assert NORMALISATIONS["raw"].apply(-3.5) == -3.5
    assert NORMALISATIONS["sigmoid"].apply(-1000.0) == 0.0 and NORMALISATIONS["sigmoid"].apply(1000.0) == 1.0


def test_a_correct_sum_outscores_the_policys_usual_mistake_and_missing_or_malformed_answers(scorer):
    """The embedded model's property on 50 held-out questions: the right sum beats sum + 1 (the policy's typical
    mistake; 96 % when built) on at least 90 %, and beats no box, no answer or an unclosed box on all."""
    with open(EMBEDDED_EVAL_DATA, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:50]
    beats_plus_one = []
    for row in rows:
        answer = int(row["gt_answer"])
        responses = (f"\\boxed{{{answer}}}", f"\\boxed{{{answer + 1}}}", str(answer), "", f"\\boxed{{{answer}")
        correct, plus_one, *malformed = scorer.score_texts([scorer.render(response, row) for response in responses])
        beats_plus_one.append(correct > plus_one)
        assert correct > max(malformed), (row, correct, malformed)
    assert sum(beats_plus_one) >= 0.9 * len(rows), beats_plus_one


def test_a_malformed_row_is_an_infra_error_not_an_exception(scorer, eval_rows):
    records = scorer.score_batch(["\\boxed{1}", "\\boxed{1}"], [{"prompt": "no messages"}, eval_rows[0]])
    assert records[0].status == "infra_error" and "messages" in records[0].details["error"]
    assert records[1].status == OK


def test_a_classifier_with_several_labels_is_refused(tmp_path, model_dir):
    config = Qwen2Config(vocab_size=112, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=3, pad_token_id=0)  # fmt: skip
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    RewardModelScorer(str(model_dir)).tokenizer.save_pretrained(tmp_path)
    with pytest.raises(RewardConfigError, match=rf"{tmp_path}.*num_labels=3"):
        RewardModelScorer(str(tmp_path))


def test_a_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(RewardConfigError, match=r"reward model .*nowhere.*cannot load"):
        RewardModelScorer(str(tmp_path / "nowhere"))


def test_an_unknown_normalisation_is_refused():
    with pytest.raises(RewardConfigError, match="normalisation 'softmax'"):
        RewardModelConfig(normalisation="softmax")


@pytest.fixture
def deterministic_torch():
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def test_the_build_is_deterministic(tmp_path, deterministic_torch):
    import dataclasses

    train = dataclasses.replace(build.REWARD_MODEL_TRAIN, clean_steps=3)
    sum_train = dataclasses.replace(build.SUM_TRAIN, clean_steps=2)
    build.build_reward_model(tmp_path / "first", train, sum_train)
    build.build_reward_model(tmp_path / "second", train, sum_train)
    first = (tmp_path / "first" / "model.safetensors").read_bytes()
    assert first == (tmp_path / "second" / "model.safetensors").read_bytes()
    assert (tmp_path / "first" / "tokenizer.json").read_bytes() == (tmp_path / "second" / "tokenizer.json").read_bytes()
