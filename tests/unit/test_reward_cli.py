"""``python -m colossal_rl.reward``: score a jsonl round trip; malformed input names file and line."""

import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "colossal_rl.reward", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
def test_score_boxed_round_trip(tmp_path):
    rows = [
        {"response": r"\boxed{\frac{1}{2}}", "gt_answer": "0.5"},
        {"response": r"\boxed{3}", "gt_answer": "4"},
        {"response": "no answer", "gt_answer": "4"},
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    output = tmp_path / "out.jsonl"
    result = run_cli(
        "score", "--reward-type", "boxed", "--input", str(tmp_path / "rows.jsonl"), "--output", str(output)
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["reward"] for r in records] == [1.0, 0.0, 0.0]
    assert [r["status"] for r in records] == ["ok", "ok", "format_error"]
    assert [r["line"] for r in records] == [1, 2, 3]
    assert all({"details", "format_ok", "answer_ok"} <= set(r) for r in records)


@pytest.mark.slow
def test_score_code_to_stdout(tmp_path):
    tests = {"inputs": ["4\n"], "outputs": ["16\n"]}
    rows = [
        {"response": "```python\nx = int(input())\nprint(x * x)\n```", "test_cases": tests},
        {"response": "```python\nprint(15)\n```", "test_cases": tests},
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    args = ["score", "--reward-type", "code", "--input", str(tmp_path / "rows.jsonl"), "--option", "timeout_s=3"]
    args += ["--option", "uid_base=62200"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["reward"] for r in records] == [1.0, 0.0]
    assert records[1]["details"]["verdicts"] == ["wrong_answer"]


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"response": "x", "gt_answer": "1"}\n\n{"response": "y", "gt_answer": \n')
    result = run_cli("score", "--reward-type", "boxed", "--input", str(path))
    assert result.returncode == 2
    assert f"{path}:3: invalid JSON" in result.stderr
    path.write_text('{"gt_answer": "1"}\n')
    result = run_cli("score", "--reward-type", "boxed", "--input", str(path))
    assert result.returncode == 2 and f"{path}:1: missing string field 'response'" in result.stderr


def test_check_sandbox_command():
    result = run_cli("check-sandbox")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == {"ok": True, "error": None}
