"""The generative judge: templates, verdict rules, and JudgeScorer on a loopback stub server and on the embedded model.

The stub (``judge_stub_server``) is a real HTTP server, so retries, timeouts, deadlines, concurrency and the
token header are exercised over real sockets; only the judge's answers are scripted.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network

import pytest
from judge_stub_server import (
    JudgeStub,
    StubReply,
    closed_port,
    echo_marker,
    echo_number,
    fail_then,
    fixed,
    garbage,
    sleeping,
    status,
)

import colossal_rl
from colossal_rl.reward.judge import (
    ChoiceRule,
    JudgeScorer,
    JudgeTemplate,
    NumberRule,
    VerdictError,
    parse_verdict_rule,
)
from colossal_rl.reward.judge_client import JudgeEndpointConfig, OpenAICompatibleJudge
from colossal_rl.reward.records import INFRA_ERROR, OK
from colossal_rl.reward.user_functions import RewardConfigError

TEMPLATE = JudgeTemplate("Question: {prompt}\nAnswer: {response}\nReference: {reference}\nGive Score: 0 or 1.")
EMBEDDED_MODEL = Path(colossal_rl.__file__).parent / "assets" / "tiny_qwen2"


def row(question: str = "2+2=?", answer: str | None = "4") -> dict:
    row = {"messages": {"role": "user", "content": question}}
    return row if answer is None else {**row, "gt_answer": answer}


def endpoint_judge(url: str, **options) -> OpenAICompatibleJudge:
    settings = {"timeout_s": 5.0, "retries": 2, "backoff_s": 0.01, "deadline_s": 20.0, "concurrency": 4, **options}
    return OpenAICompatibleJudge(JudgeEndpointConfig(url=url, model="judge-model", **settings))


def judge_scorer(url: str, rule: str = "number", template: JudgeTemplate = TEMPLATE, **options) -> JudgeScorer:
    return JudgeScorer(template, parse_verdict_rule(rule), endpoint_judge(url, **options))


def infra_reason(record) -> str:
    assert record.status == INFRA_ERROR and record.reward == 0.0
    return record.details["error"]


# ------------------------------------------------------------------ templates
def test_template_fills_fields_and_leaves_other_braces_alone():
    template = JudgeTemplate('P={prompt} R={response} G={reference} \\boxed{} {{prompt}} {"score": 1}')
    rendered = template.render(prompt="f(x)={x}", response="{reference} }{ {{", reference="\\frac{1}{2}")
    assert rendered == 'P=f(x)={x} R={reference} }{ {{ G=\\frac{1}{2} \\boxed{} {prompt} {"score": 1}'


def test_template_without_response_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Rate {prompt} against {reference}")
    with pytest.raises(RewardConfigError, match=f"{path}.*no {{response}}"):
        JudgeTemplate.from_file(path)


def test_template_unknown_fields_are_named(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("{response} {answer} {question} {{literal}}")
    with pytest.raises(RewardConfigError, match=r"unknown field\(s\) \['answer', 'question'\]"):
        JudgeTemplate.from_file(path)


def test_unreadable_template_file_is_an_error(tmp_path):
    with pytest.raises(RewardConfigError, match="missing.txt"):
        JudgeTemplate.from_file(tmp_path / "missing.txt")


# ------------------------------------------------------------------ verdict rules
@pytest.mark.parametrize(
    ("verdict", "score"),
    [
        ("The answer is fine. \\boxed{7}", 0.7),
        ("Step 1 checks 3 things.\nScore: 8\nI compared 2 answers.", 0.8),  # a Score line beats later numbers
        ("Score: 2 ... final \\boxed{10}", 1.0),  # a box beats a Score line
        ("between 1 and 3, I give 5", 0.5),  # else the last number
        ("score = 0", 0.0),
        ("Score: 2.5", 0.25),
    ],
)
def test_number_rule_maps_the_chosen_number_onto_0_1(verdict, score):
    assert parse_verdict_rule("number:0,10").score(verdict) == pytest.approx(score)


@pytest.mark.parametrize(
    ("verdict", "reason"),
    [("Score: 12", "outside"), ("no digits here", "no number"), ("\\boxed{good}", "not a number"), ("-1", "outside")],
)
def test_number_rule_refuses(verdict, reason):
    with pytest.raises(VerdictError, match=reason):
        NumberRule(0, 10).score(verdict)


def test_number_rule_default_range_is_0_1():
    assert parse_verdict_rule("number").score("confidence 0.75") == 0.75


def test_choice_rule_takes_the_last_choice_in_any_case():
    rule = parse_verdict_rule("choice:yes=1,no=0")
    assert rule.score("Yes it looks right at first, but no: NO.") == 0.0
    assert rule.score("no wait, yes") == 1.0
    assert rule.score("\\boxed{ YES }") == 1.0
    with pytest.raises(VerdictError, match="none of"):
        rule.score("nobody knows, yesterday")  # whole words only
    with pytest.raises(VerdictError, match="boxed verdict 'maybe'"):
        rule.score("yes \\boxed{maybe}")


def test_choice_rule_prefers_longer_tokens_and_refuses_duplicates():
    rule = ChoiceRule((("correct", 1.0), ("incorrect", 0.0), ("[[A]]", 1.0)))
    assert rule.score("it is correct... no, incorrect") == 0.0
    assert rule.score("[[a]]") == 1.0
    with pytest.raises(ValueError, match="duplicate"):
        ChoiceRule((("A", 1.0), ("a", 0.0)))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown judge rule"),
        ("number:5", "number:LO,HI"),
        ("number:3,1", "LO < HI"),
        ("choice:A", "TOKEN=SCORE"),
        ("choice:A=2,B=0", "score in"),
    ],
)
def test_bad_rule_specs_are_config_errors(spec, message):
    with pytest.raises(RewardConfigError, match=message):
        parse_verdict_rule(spec)


# ------------------------------------------------------------------ JudgeScorer on the stub endpoint
def test_scores_from_the_endpoint_and_the_request_it_gets(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("judge-secret\n")
    with JudgeStub(echo_number()) as stub:
        scorer = judge_scorer(stub.url, token_file=str(token_file))
        records = scorer.score_batch(["CORRECT, 4", "5"], [row(), row()])
        scorer.close()
    assert [(r.reward, r.answer_ok, r.status) for r in records] == [(1.0, True, OK), (0.0, False, OK)]
    assert records[0].details["verdict"] == "Reasoning...\nScore: 1"
    request = stub.requests[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer judge-secret"
    assert request.body["model"] == "judge-model" and request.body["temperature"] == 0
    assert [m["role"] for m in request.body["messages"]] == ["user"]
    assert {r.body["messages"][0]["content"] for r in stub.requests} == {
        TEMPLATE.render(prompt="2+2=?", response=response, reference="4") for response in ("CORRECT, 4", "5")
    }


def test_verdicts_come_back_in_prompt_order():
    template = JudgeTemplate("#{response}")
    with JudgeStub(echo_marker()) as stub:
        scorer = judge_scorer(stub.url, "number:0,9", template, concurrency=3)
        records = scorer.score_batch([str(n) for n in range(10)], [row()] * 10)
    assert [r.reward for r in records] == pytest.approx([n / 9 for n in range(10)])


def test_garbage_verdicts_are_counted_infra_errors_with_one_log_line(caplog):
    with JudgeStub(garbage()) as stub, caplog.at_level(logging.WARNING):
        scorer = judge_scorer(stub.url, "choice:A=1,B=0")
        records = scorer.score_batch(["x", "y", "z"], [row()] * 3)
    for record in records:
        assert "did not parse" in infra_reason(record) and "I cannot decide, sorry." in infra_reason(record)
    assert (scorer.unparsed, scorer.failed) == (3, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "3 of 3 samples" in warnings[0] and "\n" not in warnings[0]


def test_server_errors_are_retried_then_scored():
    with JudgeStub(fail_then(2, fixed("Score: 1"), status=500)) as stub:
        scorer = judge_scorer(stub.url, retries=2)
        record = scorer.score("CORRECT", row())
    assert (record.status, record.reward, len(stub.requests)) == (OK, 1.0, 3)
    assert scorer.failed == 0


def test_rate_limit_is_retried_but_a_refused_token_is_not():
    with JudgeStub(fail_then(1, fixed("1"), status=429)) as stub:
        assert judge_scorer(stub.url).score("a", row()).status == OK
    with JudgeStub(status(401)) as stub:
        scorer = judge_scorer(stub.url, retries=3)
        reason = infra_reason(scorer.score("a", row()))
    assert "HTTP 401" in reason and len(stub.requests) == 1 and scorer.failed == 1


def test_endpoint_down_is_a_one_line_infra_error_quickly():
    url = f"http://127.0.0.1:{closed_port()}"
    scorer = judge_scorer(url, retries=2, backoff_s=0.05)
    started = time.monotonic()
    records = scorer.score_batch(["a", "b"], [row(), row()])
    assert time.monotonic() - started < 5
    for record in records:
        reason = infra_reason(record)
        assert reason == f"judge failed: judge endpoint {url}/v1/chat/completions: connection refused after 3 tries"
    assert scorer.failed == 2


def test_slow_endpoint_times_out_within_the_bounds():
    with JudgeStub(sleeping(3.0)) as stub:
        scorer = judge_scorer(stub.url, timeout_s=0.3, retries=1)
        started = time.monotonic()
        reason = infra_reason(scorer.score("a", row()))
        elapsed = time.monotonic() - started
    assert "no answer within 0.3s after 2 tries" in reason
    assert elapsed < 2.0


def test_batch_deadline_bounds_the_whole_call():
    with JudgeStub(sleeping(3.0)) as stub:
        scorer = judge_scorer(stub.url, timeout_s=10.0, deadline_s=0.5, concurrency=1)
        started = time.monotonic()
        records = scorer.score_batch(["a", "b", "c"], [row()] * 3)
        elapsed = time.monotonic() - started
    assert elapsed < 1.5
    assert all("deadline" in infra_reason(r) for r in records)
    assert len(stub.requests) == 1  # the queued samples were never sent


def test_concurrency_is_bounded():
    with JudgeStub(sleeping(0.2, "1")) as stub:
        records = judge_scorer(stub.url, concurrency=2).score_batch(["a"] * 6, [row()] * 6)
    assert all(r.status == OK for r in records)
    assert len(stub.requests) == 6 and stub.max_in_flight == 2


def test_malformed_reply_and_unrenderable_row_are_infra_errors():
    with JudgeStub(lambda number, prompt: StubReply(raw_body=b"<html>oops</html>")) as stub:
        scorer = judge_scorer(stub.url)
        records = scorer.score_batch(["a", "b"], [row(), row(answer=None)])
    assert "malformed reply" in infra_reason(records[0])
    assert "no 'gt_answer'" in infra_reason(records[1])
    assert len(stub.requests) == 1  # the row without a reference was never sent


def test_unreadable_token_file_is_a_config_error(tmp_path):
    with pytest.raises(RewardConfigError, match="token file"):
        endpoint_judge("http://127.0.0.1:1", token_file=str(tmp_path / "absent"))


# ------------------------------------------------------------------ the embedded model as the judge
@pytest.fixture(scope="module")
def local_judge():
    from colossal_rl.reward.judge_local import LocalModelJudge

    return LocalModelJudge(str(EMBEDDED_MODEL), max_new_tokens=24)


def test_embedded_model_judges_end_to_end(local_judge):
    template = JudgeTemplate("{prompt} {response}? \\boxed{}")
    scorer = JudgeScorer(template, parse_verdict_rule("number:0,1000"), local_judge)
    responses = ["4", "5", "x" * 300]  # the last does not fit the model's 256 positions
    records = scorer.score_batch(responses, [row("2+2=?"), row("1+1=?"), row()])
    assert all(r.status in (OK, INFRA_ERROR) for r in records)
    assert "exceeds the judge model's 256 positions" in infra_reason(records[2])
    assert scorer.failed >= 1 and scorer.failed + scorer.unparsed == sum(r.status == INFRA_ERROR for r in records)


def test_embedded_judge_batches_as_it_generates_alone(local_judge):
    prompts = ["12+30=?", "Is 4 the answer to 2+2=? Score it"]
    assert local_judge.complete(prompts) == [local_judge.complete([p])[0] for p in prompts]
