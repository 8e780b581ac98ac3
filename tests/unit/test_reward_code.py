"""Code rewards: the verdict of one run and the record of a program (fast: hand-made runs, no sandbox), and real
stdin/stdout and call-based problems in the sandbox (slow): right, wrong, crashing and too-slow solutions; bad
test data."""

import pytest

from colossal_rl.reward import build_reward_scorer
from colossal_rl.reward.call_harness import RESULT_MARKER
from colossal_rl.reward.code_runner import LocalCodeRunner
from colossal_rl.reward.code_scorer import CodeScorer
from colossal_rl.reward.code_tests import (
    TestCaseError,
    TestCases,
    TestReport,
    judge,
    normalized_lines,
    parse_test_cases,
)
from colossal_rl.reward.sandbox import RunResult, SandboxConfig


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


# ------------------------------------------------------------------ verdicts (fast: hand-made runs, no sandbox)
STDIN_CASES = TestCases(["3\n1 2 3\n"], ["6\n"])
CALL_CASES = TestCases([[[2, 7, 11, 15], 9]], [[0, 1]], fn_name="twoSum")


def ran(stdout: bytes, exit_code: int | None = 0, **outcome) -> RunResult:
    return RunResult(stdout=stdout, stderr=b"", exit_code=exit_code, **outcome)


def returned(value_json: str, noise: str = "") -> bytes:
    """The call harness's stdout: the program's own prints (if it got past the harness), the marker, the value."""
    return f"{noise}{RESULT_MARKER}\n{value_json}\n".encode()


@pytest.mark.parametrize(
    ("result", "verdict"),
    [
        pytest.param(ran(b"6\n"), "passed", id="right"),
        pytest.param(ran(b"  6 \r\n\n"), "passed", id="right_with_whitespace"),
        pytest.param(ran(b"6"), "passed", id="right_without_newline"),
        pytest.param(ran(b"7\n"), "wrong_answer", id="wrong"),
        pytest.param(ran(b"6\n6\n"), "wrong_answer", id="an_extra_line"),
        pytest.param(ran(b""), "wrong_answer", id="no_output"),
        pytest.param(ran(b"", exit_code=1), "runtime_error", id="crash"),
        pytest.param(ran(b"6\n", exit_code=1), "runtime_error", id="right_output_then_crash"),
        pytest.param(ran(b"6\n", exit_code=3), "runtime_error", id="right_output_then_exit_3"),
        pytest.param(ran(b"6\n", exit_code=-9), "runtime_error", id="right_output_then_killed"),
        pytest.param(ran(b"6\n", exit_code=-9, timed_out=True), "timeout", id="timeout"),
        pytest.param(ran(b"6\n", exit_code=-9, output_limited=True), "output_limit", id="output_limit"),
        pytest.param(ran(b"6\n", exit_code=None, infra_error="sandbox failed"), "infra_error", id="infra_error"),
    ],
)
def test_stdin_verdict(result, verdict):
    assert judge(result, STDIN_CASES, 0) == verdict


@pytest.mark.parametrize(
    ("result", "verdict"),
    [
        pytest.param(ran(returned("[0, 1]")), "passed", id="right"),
        pytest.param(ran(returned("[0, 1]", noise="debug print\n")), "passed", id="right_after_prints"),
        pytest.param(ran(returned("[1, 0]")), "wrong_answer", id="wrong"),
        pytest.param(ran(b"[0, 1]\n"), "wrong_answer", id="no_marker"),
        pytest.param(ran(returned("[0, 1")), "wrong_answer", id="not_json"),
        pytest.param(ran(returned("[0, 1]"), exit_code=1), "runtime_error", id="right_value_then_crash"),
        # a program that writes the marker itself and then crashes in the call: still a crash
        pytest.param(ran(returned("[0, 1]"), exit_code=-11), "runtime_error", id="forged_marker_then_killed"),
        pytest.param(ran(returned("[0, 1]"), exit_code=-9, timed_out=True), "timeout", id="timeout"),
    ],
)
def test_call_verdict(result, verdict):
    assert judge(result, CALL_CASES, 0) == verdict


def test_call_values_compare_as_datasets_write_them():
    assert judge(ran(returned("[0, 1]")), TestCases([[1]], [[[0, 1]]], fn_name="f"), 0) == "passed"  # APPS wrapping
    assert judge(ran(returned("[0, 1]")), TestCases([[1]], ["[0, 1]"], fn_name="f"), 0) == "passed"  # JSON text
    assert judge(ran(returned('"[0, 1]"')), TestCases([[1]], ["[0, 1]"], fn_name="f"), 0) == "passed"
    assert judge(ran(returned("[0, 1]")), TestCases([[1]], [[0, 1, 2]], fn_name="f"), 0) == "wrong_answer"


class ScriptedSandbox:
    """Stands in for bubblewrap: the run result of each stdin, written by hand."""

    unavailable = None

    def __init__(self, results: dict[bytes, RunResult]):
        self.results = results

    def run(self, files, stdin, fn_name=None, timeout_s=None) -> RunResult:
        return self.results[stdin]


def scripted_scorer(results: dict[bytes, RunResult], early_stop: bool = False) -> CodeScorer:
    """The real runner and scorer around a scripted sandbox (the real one is never probed: bwrap is absent)."""
    config = SandboxConfig(max_parallel=1, uid_count=1, early_stop=early_stop, bwrap_executable="/nonexistent/bwrap")
    runner = LocalCodeRunner(config)
    runner.sandbox = ScriptedSandbox(results)
    return CodeScorer(runner)


def test_a_program_that_prints_the_right_answers_then_crashes_scores_zero():
    right = {b"3\n1 2 3\n": ran(b"6\n"), b"1\n-5\n": ran(b"-5\n"), b"4\n10 20 30 40\n": ran(b"100\n")}
    crashes_last = right | {b"4\n10 20 30 40\n": ran(b"100\n", exit_code=1)}
    for results, reward, verdicts in (
        (right, 1.0, ["passed"] * 3),
        (crashes_last, 0.0, ["passed", "passed", "runtime_error"]),
    ):
        scorer = scripted_scorer(results)
        try:
            record = scorer.score(fenced(SUM_RIGHT), {"test_cases": SUM_TESTS})
        finally:
            scorer.close()
        assert (record.reward, record.answer_ok, record.status) == (reward, reward == 1.0, "ok"), record
        assert record.details["verdicts"] == verdicts
        assert record.details["pass_fraction"] == verdicts.count("passed") / 3


def report_record(report: TestReport):
    class Runner:
        def run_programs(self, jobs, deadline=None):
            return [report] * len(jobs)

        def close(self):
            pass

    return CodeScorer(Runner()).score(fenced("print(6)"), {"test_cases": SUM_TESTS})


def test_program_records_from_their_reports():
    record = report_record(TestReport(["passed", "passed", "passed"], case_seconds=[0.1, 0.2, 0.1]))
    assert (record.reward, record.answer_ok, record.status, record.details["passed"]) == (1.0, True, "ok", 3)
    record = report_record(TestReport(["passed", "wrong_answer", "skipped"]))
    assert (record.reward, record.status, record.details["pass_fraction"]) == (0.0, "ok", 1 / 3)
    record = report_record(TestReport(["passed", "timeout", "runtime_error"]))
    assert (record.reward, record.status) == (0.0, "timeout")
    # a report carrying an infrastructure error is never a pass, whatever its verdicts say
    record = report_record(TestReport(["passed"] * 3, infra_error="request deadline exceeded"))
    assert (record.reward, record.answer_ok, record.status) == (0.0, False, "infra_error")


def test_rows_and_responses_without_a_program_to_run_score_zero_without_the_runner():
    scorer = scripted_scorer({})  # any run would raise KeyError
    try:
        no_code = scorer.score("I would just print 6.", {"test_cases": SUM_TESTS})
        no_tests = scorer.score(fenced("print(6)"), {"gt_answer": "6"})
        bad_tests = scorer.score(fenced("print(6)"), {"test_cases": {"inputs": ["1"], "outputs": []}})
    finally:
        scorer.close()
    assert (no_code.reward, no_code.status, no_code.format_ok) == (0.0, "format_error", False)
    assert (no_tests.reward, no_tests.status) == (0.0, "infra_error")
    assert (bad_tests.reward, bad_tests.status) == (0.0, "infra_error")


# ------------------------------------------------------------------ real programs in the sandbox (slow)
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
def test_right_output_then_a_crash_scores_zero(scorer):
    exits = SUM_RIGHT + "\nimport sys\nsys.stdout.flush()\nsys.exit(3)"
    raises = SUM_RIGHT + "\nimport sys\nsys.stdout.flush()\nraise RuntimeError('after the answer')"
    records = scorer.score_batch([fenced(exits), fenced(raises)], [{"test_cases": SUM_TESTS}] * 2)
    for record in records:
        assert (record.reward, record.answer_ok) == (0.0, False), record
        assert record.details["verdicts"][0] == "runtime_error"
    assert "after the answer" in records[1].details["stderr_tail"]
    # a call-based program whose value the harness has written, and whose exit then fails
    program = "import atexit, os\natexit.register(os._exit, 1)\ndef double(x):\n    return 2 * x\n"
    tests = {"inputs": [[3]], "outputs": [6]}
    record = scorer.score_batch([fenced(program)], [{"test_cases": tests, "fn_name": "double"}])[0]
    assert record.reward == 0.0 and record.details["verdicts"] == ["runtime_error"], record
    right = scorer.score_batch(
        [fenced("def double(x):\n    return 2 * x\n")], [{"test_cases": tests, "fn_name": "double"}]
    )
    assert right[0].reward == 1.0, right[0]


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
