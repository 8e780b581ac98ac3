"""Code rewards on real stdin/stdout problems: right, wrong, crashing and too-slow solutions; bad test data."""

import pytest

from colossal_rl.reward import build_reward_scorer
from colossal_rl.reward.code_tests import TestCaseError, normalized_lines, parse_test_cases


def fenced(code: str) -> str:
    return f"Let me solve it.\n```python\n{code.strip()}\n```\nDone."


SUM_TESTS = {"inputs": ["3\n1 2 3\n", "1\n-5\n", "4\n10 20 30 40\n"], "outputs": ["6\n", "-5\n", "100\n"]}
SUM_RIGHT = "n = int(input())\nprint(sum(map(int, input().split()[:n])))"
SUM_WRONG = "n = int(input())\nprint(sum(map(int, input().split()[: n - 1])))"
SUM_CRASH = "n = int(input())\nprint(1 // (n - n))"

FIB_TESTS = {"inputs": ["10\n", "45\n"], "outputs": ["55\n", "1134903170\n"]}
FIB_FAST = """
n = int(input())
a, b = 0, 1
for _ in range(n):
    a, b = b, a + b
print(a)
"""
FIB_SLOW = """
import sys
sys.setrecursionlimit(10000)
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
print(fib(int(input())))
"""
WORDS_TESTS = {"inputs": ["hello world\n", "  a  b   c \n"], "outputs": ["world hello", "c b a\n\n"]}
WORDS_RIGHT = "print(' '.join(reversed(input().split())))"


@pytest.fixture(scope="module")
def scorer():
    scorer = build_reward_scorer("code", timeout_s=2.0, max_parallel=2, uid_base=62100, uid_count=4)
    yield scorer
    scorer.close()


def test_test_case_validation():
    assert parse_test_cases('{"inputs": ["1"], "outputs": ["2"]}').inputs == ["1"]
    assert parse_test_cases({"inputs": [["1", "2"]], "outputs": [["3"]]}).inputs == ["1\n2"]
    for bad in ("{not json", {"inputs": [], "outputs": []}, {"inputs": ["1"]}, {"inputs": ["1"], "outputs": []}, [1]):
        with pytest.raises(TestCaseError):
            parse_test_cases(bad)
    assert normalized_lines("  1   2 \r\n3\n\n") == ["1 2", "3"]


@pytest.mark.slow
def test_right_and_wrong_solutions(scorer):
    responses = [fenced(SUM_RIGHT), fenced(SUM_WRONG), fenced(SUM_CRASH), fenced(FIB_FAST), fenced(WORDS_RIGHT)]
    rows = [{"test_cases": SUM_TESTS}] * 3 + [{"test_cases": FIB_TESTS}, {"test_cases": WORDS_TESTS}]
    right, wrong, crash, fib, words = scorer.score_batch(responses, rows)
    assert (right.reward, right.answer_ok, right.status) == (1.0, True, "ok")
    assert right.details["pass_fraction"] == 1.0 and right.details["total"] == 3
    assert wrong.reward == 0.0 and wrong.status == "ok" and "wrong_answer" in wrong.details["verdicts"]
    assert crash.reward == 0.0 and crash.details["verdicts"][0] == "runtime_error"
    assert "ZeroDivisionError" in crash.details["stderr_tail"]
    assert fib.reward == 1.0
    assert words.reward == 1.0  # whitespace-normalised line comparison


@pytest.mark.slow
def test_too_slow_solution_times_out(scorer):
    record = scorer.score_batch([fenced(FIB_SLOW)], [{"test_cases": FIB_TESTS}])[0]
    assert record.reward == 0.0 and record.status == "timeout"
    assert record.details["verdicts"][1] == "timeout"


@pytest.mark.slow
def test_pass_fraction_without_early_stop():
    scorer = build_reward_scorer("code", timeout_s=2.0, early_stop=False, uid_base=62110, uid_count=2, max_parallel=2)
    try:
        tests = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["1\n", "4\n", "9\n", "15\n"]}
        record = scorer.score_batch([fenced("x = int(input())\nprint(x * x)")], [{"test_cases": tests}])[0]
    finally:
        scorer.close()
    assert record.reward == 0.0
    assert record.details["passed"] == 3 and record.details["pass_fraction"] == 0.75


@pytest.mark.slow
def test_call_based_problem(scorer):
    program = "class Solution:\n    def twoSum(self, nums, target):\n        print('noise')\n"
    program += "        seen = {}\n        for i, x in enumerate(nums):\n"
    program += (
        "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n"
    )
    tests = {"inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [[1, 2]]]}
    record = scorer.score_batch([fenced(program)], [{"test_cases": tests, "fn_name": "twoSum"}])[0]
    assert record.reward == 1.0, record
    wrong = scorer.score_batch([fenced("def f(a):\n    return a")], [{"test_cases": tests, "fn_name": "twoSum"}])[0]
    assert wrong.reward == 0.0 and wrong.status == "ok"


@pytest.mark.slow
def test_bad_rows_are_infra_errors_never_passes(scorer):
    rows = [
        {"test_cases": {"inputs": [], "outputs": []}},
        {"test_cases": '{"inputs": ["1"], "outputs": '},
        {"test_cases": {"inputs": ["1"], "outputs": ["1", "2"]}},
        {"gt_answer": "no tests"},
    ]
    records = scorer.score_batch([fenced("print(1)")] * len(rows), rows)
    assert [r.status for r in records] == ["infra_error"] * len(rows)
    assert all(r.reward == 0.0 for r in records)
    no_code = scorer.score_batch(["I would just print 6."], [{"test_cases": SUM_TESTS}])[0]
    assert (no_code.status, no_code.format_ok, no_code.reward) == ("format_error", False, 0.0)


def test_unavailable_sandbox_fails_closed():
    scorer = build_reward_scorer("code", bwrap_executable="/nonexistent/bwrap", uid_base=62120, uid_count=2)
    try:
        record = scorer.score_batch([fenced("print(6)")], [{"test_cases": {"inputs": [""], "outputs": ["6"]}}])[0]
    finally:
        scorer.close()
    assert record.status == "infra_error" and record.reward == 0.0
    assert "sandbox unavailable" in record.details["error"]
