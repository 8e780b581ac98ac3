"""Math rewards: answer extraction and normalisation, the verdicts (fast: pure functions, with math-verify's
outcome written by hand), and equivalence through the real math-verify workers and their timeout (slow)."""

import os
import signal
import threading

import pytest

from colossal_rl.reward import build_reward_scorer
from colossal_rl.reward.extract import (
    extract_boxed_answer,
    extract_tagged_answer,
    find_boxed,
    has_think_answer_shape,
    last_python_block,
    normalize_answer,
    normalize_for_fallback,
)
from colossal_rl.reward.math_pool import MathCheck
from colossal_rl.reward.math_scorer import EXTRACTORS, finish_answer, prepare_answer

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


NORMALIZED = [
    # (answer, normalize_answer's result, written by hand)
    ("1", "1"),
    ("10", "10"),
    ("100", "100"),
    ("100.", "100"),  # a sentence's full stop
    ("0.1", "0.1"),
    ("1.0", "1.0"),  # conservative: "1.0" vs "1" is math-verify's call, not a string rewrite's
    ("2000", "2000"),
    (" $ 10 $ ", "10"),
    (r"\(10\)", "10"),
    (r"\[ 10 \]", "10"),
    (r"\text{10}", "10"),
    (r"\mathbf{\text{20}}", "20"),
    (r"10\,000", "10000"),
    (r"\left( 1, 0 \right)", "(1,0)"),
    (r"\tfrac{1}{10}", r"\frac{1}{10}"),
    ("x = 10", "x=10"),
]


@pytest.mark.parametrize(("answer", "expected"), NORMALIZED)
def test_normalize_answer_hand_computed(answer, expected):
    assert normalize_answer(answer) == expected


def test_normalisation_keeps_different_numbers_apart():
    numbers = ["0", "1", "10", "100", "1000", "0.1", "0.01", "1.0", "10.0", "01", "-1", "-10", "2", "20", "200"]
    assert len({normalize_answer(n) for n in numbers}) == len(numbers)
    assert len({normalize_for_fallback(n) for n in numbers}) == len(numbers)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("North-East", "north-east"), (r"90^\circ", "90"), (r"90^{\circ}", "90"), (r"50\%", "50"), (r"\$10", "10"),
     ("{10}", "10"), ("100", "100"), ("10.", "10")],
)  # fmt: skip
def test_normalize_for_fallback_hand_computed(answer, expected):
    assert normalize_for_fallback(answer) == expected


def test_boxed_answers_that_differ_are_several_candidates():
    assert extract_boxed_answer(r"\boxed{10} no, \boxed{1}").candidates == ("10", "1")
    assert extract_boxed_answer(r"\boxed{100} so \boxed{100.}").candidates == ("100",)
    assert extract_boxed_answer(r"\boxed{1} or \boxed{1.0}").candidates == ("1", "1.0")


# ------------------------------------------------------------------ verdicts (fast, math-verify's outcome by hand)
CORRECT, WRONG, UNPARSED = MathCheck("correct"), MathCheck("wrong"), MathCheck("unparsed")


def verdict(response, gold, check=None, reward_type="boxed", needs_format=False):
    """The record of ``response``; ``check`` is math-verify's outcome, None when the answer must be decided
    without it (a pending answer then fails the test, as does a decided one that was given a check)."""
    prepared = prepare_answer(response, {"gt_answer": gold}, EXTRACTORS[reward_type], needs_format)
    if check is None:
        assert prepared.record is not None, f"{response!r} vs {gold!r} was left for math-verify"
        return prepared.record
    assert prepared.record is None, f"{response!r} vs {gold!r} was decided without math-verify: {prepared.record}"
    assert (prepared.answer, prepared.gold) == (EXTRACTORS[reward_type](response).answer, gold)
    return finish_answer(prepared, check, needs_format)


VERDICTS = [
    # (response, gold, math-verify's outcome or None if never asked, reward, status)
    pytest.param(r"so the answer is \boxed{13}", "13", None, 1.0, "ok", id="equal"),
    pytest.param(r"\boxed{\text{13}}", "13", None, 1.0, "ok", id="equal_after_normalising"),
    pytest.param(r"\boxed{$10$}", "10", None, 1.0, "ok", id="delimiters"),
    pytest.param(r"\boxed{10.}", "10", None, 1.0, "ok", id="full_stop"),
    pytest.param(r"\boxed{10}", r"\boxed{10}", None, 1.0, "ok", id="boxed_gold"),
    pytest.param(r"\boxed{10}", "1", WRONG, 0.0, "ok", id="10_is_not_1"),
    pytest.param(r"\boxed{100}", "10", WRONG, 0.0, "ok", id="100_is_not_10"),
    pytest.param(r"\boxed{1}", "100", WRONG, 0.0, "ok", id="1_is_not_100"),
    pytest.param(r"\boxed{14}", "13", WRONG, 0.0, "ok", id="wrong"),
    pytest.param(r"\boxed{\frac{1}{2}}", "0.5", CORRECT, 1.0, "ok", id="equivalent"),
    pytest.param(r"\boxed{3} or maybe \boxed{4}", "3", None, 0.0, "ambiguous_answer", id="two_answers"),
    pytest.param(r"\boxed{10} no, \boxed{1}", "1", None, 0.0, "ambiguous_answer", id="10_then_1"),
    pytest.param(r"\boxed{3} so again \boxed{3}", "3", None, 1.0, "ok", id="one_answer_twice"),
    pytest.param(r"\boxed{3 \text{ or } 4}", "3", None, 0.0, "ambiguous_answer", id="hedged"),
    pytest.param("the answer is 13", "13", None, 0.0, "format_error", id="no_box"),
    pytest.param(r"\boxed{North-East}", "north-east", UNPARSED, 1.0, "string_fallback", id="fallback_equal"),
    pytest.param(r"\boxed{North-West}", "north-east", UNPARSED, 0.0, "string_fallback", id="fallback_differs"),
    pytest.param(r"\boxed{10}", "1", UNPARSED, 0.0, "string_fallback", id="fallback_10_is_not_1"),
    pytest.param(r"\boxed{90^\circ}", "90", UNPARSED, 1.0, "string_fallback", id="fallback_degrees"),
    pytest.param(r"\boxed{10^{10^{10}}}", "1", MathCheck("timeout", "5s"), 0.0, "timeout", id="timeout"),
    pytest.param(r"\boxed{2}", "2.0", MathCheck("error", "crashed"), 0.0, "infra_error", id="verifier_error"),
]


@pytest.mark.parametrize(("response", "gold", "check", "reward", "status"), VERDICTS)
def test_boxed_verdicts(response, gold, check, reward, status):
    record = verdict(response, gold, check)
    assert (record.reward, record.status) == (reward, status), record
    assert record.answer_ok == (reward == 1.0)
    assert record.format_ok == (status not in ("format_error", "infra_error"))


def test_a_row_without_gold_is_an_infra_error_never_a_pass():
    for row in ({"question": "no gold"}, {"gt_answer": ""}, {"gt_answer": [1]}):
        record = prepare_answer(r"\boxed{1}", row, EXTRACTORS["boxed"], False).record
        assert (record.reward, record.status) == (0.0, "infra_error")


def test_tagged_verdicts_need_the_shape_for_reward():
    shaped, unshaped = "<think>half</think><answer>1/2</answer>", "I think <answer>1/2</answer>"
    for needs_format, rewards in ((True, (1.0, 0.0)), (False, (1.0, 1.0))):
        for response, reward in zip((shaped, unshaped), rewards, strict=True):
            prepared = prepare_answer(response, {"gt_answer": "0.5"}, EXTRACTORS["think_answer_tags"], needs_format)
            record = finish_answer(prepared, CORRECT, needs_format)
            assert (record.reward, record.answer_ok) == (reward, True), (response, needs_format)
    record = verdict(unshaped, "1/2", reward_type="think_answer_tags", needs_format=True)
    assert (record.reward, record.answer_ok, record.status) == (0.0, True, "format_error")
    record = verdict("<think>x</think><answer>10</answer>", "1", WRONG, "think_answer_tags", True)
    assert (record.reward, record.answer_ok, record.format_ok) == (0.0, False, True)


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
    (r"\boxed{10}", "1", 0.0),
    (r"\boxed{100}", "10", 0.0),
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


def test_a_math_worker_stuck_on_a_hostile_answer_dies_with_its_parent(tmp_path):
    """``9^{9^{9^{9}}}`` keeps a worker in sympy's big-integer power, in C code holding the GIL, where no watching
    thread runs: SIGKILLing its parent (as Ray kills a producer) must still end it (``worker_lifetime.py``)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    import psutil

    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            r"""
            from colossal_rl.reward.math_pool import MathVerifierPool

            pool = MathVerifierPool(num_workers=1, timeout_s=600)
            pool.check("1", "1")
            print(*[worker.process.pid for worker in pool._workers], flush=True)
            pool.check("1", r"$9^{9^{9^{9}}}$")
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    (pid,) = [int(pid) for pid in parent.stdout.readline().split()]

    def alive() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    try:
        deadline = time.monotonic() + 30  # until the worker is busy on the hostile answer
        while psutil.Process(pid).cpu_times().user < 1.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(), "the math worker outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if alive():
            os.kill(pid, signal.SIGKILL)
