"""Math rewards: answer extraction, equivalence through math-verify workers, and their timeout."""

import os
import signal
import threading

import pytest

from colossal_rl.reward import build_reward_scorer
from colossal_rl.reward.extract import (
    extract_tagged_answer,
    find_boxed,
    has_think_answer_shape,
    last_python_block,
    normalize_answer,
)

MATH_TIMEOUT_S = 2.0


# ------------------------------------------------------------------ extraction (fast, no workers)
def test_find_boxed_is_brace_balanced_and_ordered():
    text = r"first \boxed{\frac{1}{2}} then \fbox{x^{2}} and \boxed{\{1,2\}} and \boxed 7."
    assert find_boxed(text) == [r"\frac{1}{2}", "x^{2}", r"\{1,2\}", "7."]
    assert find_boxed(r"\boxed{unclosed {") == []


def test_think_answer_shape():
    assert has_think_answer_shape("<think>a</think> <answer>5</answer>\n")
    assert not has_think_answer_shape("<answer>5</answer>")
    assert not has_think_answer_shape("<think>a</think>junk<answer>5</answer>")
    assert not has_think_answer_shape("<think>a</think><answer>5</answer><answer>6</answer>")
    extracted = extract_tagged_answer("<think>a</think><answer>4</answer> oops <answer>6</answer>")
    assert extracted.answer == "6" and not extracted.format_ok


def test_normalize_and_code_block():
    assert normalize_answer(r"$\text{13}$") == normalize_answer("13") == "13"
    assert normalize_answer(r"\dfrac{1}{2}.") == r"\frac{1}{2}"
    assert last_python_block("```python\na=1\n```\ntext\n```py\nb=2\n```") == "b=2\n"
    assert last_python_block("```\nno tag\n```") is None


# ------------------------------------------------------------------ scoring through the worker pool
@pytest.fixture(scope="module")
def boxed_scorer():
    scorer = build_reward_scorer("boxed", timeout_s=MATH_TIMEOUT_S, num_workers=2)
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def tags_scorer():
    scorer = build_reward_scorer("think_answer_tags", timeout_s=MATH_TIMEOUT_S, num_workers=1)
    yield scorer
    scorer.close()


BOXED_CASES = [
    # (response, gold, reward)
    (r"so the answer is \boxed{13}", "13", 1.0),
    (r"\boxed{14}", "13", 0.0),
    (r"\boxed{\text{13}}", "13", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{1/2}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\frac{2}{3}}", r"\frac{3}{4}", 0.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\sqrt{3}/2", 1.0),
    (r"\boxed{\frac{1}{2006!}}", r"\frac{1}{2004!}", 0.0),
    (r"\boxed{1/2004!}", r"\frac{1}{2004!}", 1.0),
    (r"\boxed{3} or maybe \boxed{4}", "3", 0.0),
    (r"\boxed{3} so again \boxed{3}", "3", 1.0),
    (r"\boxed{3 \text{ or } 4}", "3", 0.0),
    ("the answer is 13", "13", 0.0),
]


@pytest.mark.slow
def test_boxed_answers(boxed_scorer):
    responses = [case[0] for case in BOXED_CASES]
    records = boxed_scorer.score_batch(responses, [{"gt_answer": case[1]} for case in BOXED_CASES])
    for (response, gold, reward), record in zip(BOXED_CASES, records, strict=True):
        assert record.reward == reward, (response, gold, record)
        assert record.status != "infra_error"
    by_response = dict(zip(responses, records, strict=True))
    assert by_response[r"\boxed{3} or maybe \boxed{4}"].status == "ambiguous_answer"
    assert by_response["the answer is 13"].status == "format_error"
    assert not by_response["the answer is 13"].format_ok


@pytest.mark.slow
def test_tagged_answers(tags_scorer):
    rows = [{"gt_answer": r"\frac{1}{2}"}]
    good = tags_scorer.score_batch(["<think>half</think><answer>0.5</answer>"], rows)[0]
    assert (good.reward, good.format_ok, good.answer_ok) == (1.0, True, True)
    wrong = tags_scorer.score_batch(["<think>hm</think><answer>1/3</answer>"], rows)[0]
    assert (wrong.reward, wrong.format_ok, wrong.answer_ok) == (0.0, True, False)
    # the right answer without the required shape: answer_ok, but no reward (format credit is not reward)
    unshaped = tags_scorer.score_batch(["I think <answer>1/2</answer>"], rows)[0]
    assert (unshaped.reward, unshaped.format_ok, unshaped.answer_ok) == (0.0, False, True)
    boxed_inside = tags_scorer.score_batch([r"<think>x</think><answer>\boxed{\frac{1}{2}}</answer>"], rows)[0]
    assert boxed_inside.reward == 1.0


@pytest.mark.slow
def test_string_fallback_when_unparsable(boxed_scorer):
    record = boxed_scorer.score_batch([r"\boxed{North-East}"], [{"gt_answer": "north-east"}])[0]
    assert record.status == "string_fallback" and record.reward == 1.0
    record = boxed_scorer.score_batch([r"\boxed{North-West}"], [{"gt_answer": "north-east"}])[0]
    assert record.status == "string_fallback" and record.reward == 0.0


@pytest.mark.slow
def test_missing_gold_is_infra_error(boxed_scorer):
    record = boxed_scorer.score_batch([r"\boxed{1}"], [{"question": "no gold"}])[0]
    assert record.status == "infra_error" and record.reward == 0.0


@pytest.mark.slow
def test_pathological_latex_times_out_from_a_thread(boxed_scorer):
    boxed_scorer.score_batch([r"\boxed{0.5}"], [{"gt_answer": "1/2"}])  # workers are up
    results = {}

    def score():  # how long past the timeout the verdict arrives: benchmarks/bounded_waits.py
        results["record"] = boxed_scorer.score_batch([r"\boxed{10^{10^{10^{10}}}}"], [{"gt_answer": "1"}])[0]

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=MATH_TIMEOUT_S + 20)
    assert not thread.is_alive()
    assert results["record"].status == "timeout" and results["record"].reward == 0.0
    # the killed worker is replaced and scoring goes on
    after = boxed_scorer.score_batch([r"\boxed{\frac{1}{4}}"], [{"gt_answer": "0.25"}])[0]
    assert after.reward == 1.0 and after.status == "ok"


@pytest.mark.slow
def test_crashed_worker_is_infra_error_then_replaced():
    scorer = build_reward_scorer("boxed", timeout_s=MATH_TIMEOUT_S, num_workers=1)
    try:
        assert scorer.score_batch([r"\boxed{0.5}"], [{"gt_answer": "1/2"}])[0].reward == 1.0
        (worker,) = scorer._pool._workers
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
        crashed = scorer.score_batch([r"\boxed{0.5}"], [{"gt_answer": "1/2"}])[0]
        assert crashed.status == "infra_error" and crashed.reward == 0.0
        assert scorer.score_batch([r"\boxed{0.5}"], [{"gt_answer": "1/2"}])[0].reward == 1.0
        (replacement,) = scorer._pool._workers
    finally:
        scorer.close()
    assert replacement.process.poll() is not None  # close() stopped the worker process
