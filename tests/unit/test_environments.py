"""Environments: the calculator's safe arithmetic, tool-call parsing, tool and single-turn episodes, and the
registry with ``--env path.py:Class`` plug-ins (checked before Ray starts)."""

import json
import textwrap

import pytest

from colossal_rl.environments import EnvironmentConfigError, EnvironmentContext, check_environment, environment_factory
from colossal_rl.environments.calculator import CALCULATOR, CalculatorError, evaluate, format_value
from colossal_rl.environments.tool_calls import (
    MAX_CALLS_PER_TURN,
    CallError,
    ToolCall,
    parse_tool_calls,
    run_calls,
    tools_system_text,
)
from colossal_rl.reward.user_functions import PluginScorer

ROW = {"messages": {"role": "user", "content": "What is 123*456?"}, "gt_answer": "56088"}


def exact_answer(response: str, row: dict) -> float:
    return float(response.strip() == row["gt_answer"])


def context(**options) -> EnvironmentContext:
    return EnvironmentContext(reward_scorer=PluginScorer(exact_answer, "exact"), system_prompt="Be brief.", **options)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ---------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    ("expression", "value"),
    [("1+2*3", 7), ("(1+2)*3", 9), ("-2**3", -8), ("7//2", 3), ("7%4", 3), ("1/4", 0.25), ("2**-1", 0.5)],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "unsupported"),
        ("open('/etc/passwd')", "unsupported"),
        ("x + 1", "unsupported"),
        ("'a' * 3", "unsupported"),
        ("True + 1", "unsupported"),
        ("1j * 2", "unsupported"),
        ("(lambda: 1)()", "unsupported"),
        ("9**9**9", "exponent"),
        ("10**70", "exponent"),
        ("99999999999**60", "too large"),
        ("2**60 * 2**60 * 2**60 * 2**60 * 2**60", "too large"),
        ("1e308 * 10", "too large"),
        ("1/0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**0.5", "negative"),
        ("1+" * 150 + "1", "longer"),
        ("1 +", "not an arithmetic"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_calculator_formats_values():
    assert [format_value(v) for v in (3, 2.0, 0.1 + 0.2, -1.5)] == ["3", "2", "0.3", "-1.5"]


# ---------------------------------------------------------------- parsing
def test_parse_finds_several_calls_and_the_text_around_them():
    text = f"Let me compute. {call('calculator', expression='1+1')} and {call('calculator', expression='2*3')} ok"
    parsed = parse_tool_calls(text)
    assert parsed.calls == (
        ToolCall("calculator", {"expression": "1+1"}),
        ToolCall("calculator", {"expression": "2*3"}),
    )
    assert parsed.content == "Let me compute.  and  ok"


def test_parse_accepts_qwen_newlines_and_string_arguments():
    text = '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}\n</tool_call>'
    assert parse_tool_calls(text).calls == (ToolCall("calculator", {"expression": "2+2"}),)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"arguments": {}}', '"name"'),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "not json"}', "not a JSON object"),
    ],
)
def test_parse_turns_malformed_calls_into_errors(body, reason):
    (parsed,) = parse_tool_calls(f"<tool_call>{body}</tool_call>").calls
    assert isinstance(parsed, CallError) and reason in parsed.message


def test_parse_reports_an_unterminated_call_and_missing_arguments_are_empty():
    parsed = parse_tool_calls('{"x": 1} <tool_call>{"name": "calculator"}</tool_call> tail <tool_call>{"name"')
    assert parsed.calls[0] == ToolCall("calculator", {})
    assert isinstance(parsed.calls[1], CallError) and "unterminated" in parsed.calls[1].message
    assert parsed.content == '{"x": 1}  tail'


def test_run_calls_answers_every_call_errors_included():
    turn = parse_tool_calls(
        call("calculator", expression="6*7")
        + call("search", query="x")
        + call("calculator")
        + call("calculator", expression="1", extra=2)
        + call("calculator", expression="1/0")
        + "<tool_call>{bad</tool_call>"
    )
    messages, errors = run_calls(turn.calls, {"calculator": CALCULATOR})
    contents = [m["content"] for m in messages]
    assert contents[0] == "42" and errors == 5
    assert "unknown tool 'search'" in contents[1]
    assert "missing argument(s) expression" in contents[2]
    assert "unknown argument(s) extra" in contents[3]
    assert "division by zero" in contents[4]
    assert "invalid JSON" in contents[5]
    assert all(m["role"] == "tool" for m in messages)


def test_run_calls_caps_calls_per_turn():
    turn = parse_tool_calls(call("calculator", expression="1") * (MAX_CALLS_PER_TURN + 2))
    messages, errors = run_calls(turn.calls, {"calculator": CALCULATOR})
    assert len(messages) == MAX_CALLS_PER_TURN + 2 and errors == 2
    assert "more than" in messages[-1]["content"]


def test_tools_system_text_lists_the_schemas():
    text = tools_system_text([CALCULATOR])
    assert "<tools>" in text and json.dumps(CALCULATOR.schema()) in text


# ---------------------------------------------------------------- episodes
def test_single_turn_environment_is_one_scored_step():
    env = environment_factory("single_turn")(context())
    messages = env.reset(ROW)
    assert messages == [{"role": "system", "content": "Be brief."}, ROW["messages"]]
    result = env.step("56088")
    assert result.done and result.reward == 1.0 and result.observation == ()
    assert env.step("no").reward == 0.0


def test_calculator_episode_calls_then_answers():
    env = environment_factory("calculator")(context())
    env.reset(ROW)
    first = env.step("I will compute. " + call("calculator", expression="123*456"))
    assert not first.done and first.reward is None and first.tool_calls == 1 and first.tool_errors == 0
    assert first.observation == ({"role": "tool", "name": "calculator", "content": "56088"},)
    bad = env.step("<tool_call>{oops</tool_call>")
    assert not bad.done and bad.tool_errors == 1 and "invalid JSON" in bad.observation[0]["content"]
    final = env.step("56088")
    assert final.done and final.reward == 1.0


# ---------------------------------------------------------------- registry and plug-ins
def test_unknown_name_lists_the_known_ones():
    with pytest.raises(EnvironmentConfigError, match="calculator.*python.*single_turn"):
        environment_factory("chess")


def write_plugin(tmp_path, body: str):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_plugin_class_loads_and_runs(tmp_path):
    path = write_plugin(
        tmp_path,
        """
        from colossal_rl.environments import StepResult

        class Echo:
            def __init__(self, context):
                self.context = context
            def reset(self, row):
                return [{"role": "user", "content": row["messages"]["content"]}]
            def step(self, text):
                return StepResult(reward=float(len(text)), done=True)
        """,
    )
    spec = f"{path}:Echo"
    check_environment(spec, ROW, context())
    env = environment_factory(spec)(context())
    assert env.reset(ROW)[0]["content"] == ROW["messages"]["content"]
    assert env.step("abc").reward == 3.0


@pytest.mark.parametrize(
    ("body", "attribute", "reason"),
    [
        ("x = 1", "Missing", "has nothing named 'Missing'"),
        ("def f(): pass", "f", "not a class"),
        ("class E:\n    def reset(self, row): return []", "E", "no method"),
        ("class E:\n    def __init__(self, a, b): pass\n    reset = step = lambda *a: 0", "E", "must take"),
        ("raise RuntimeError('boom')", "E", "importing .* failed: RuntimeError: boom"),
        ("class E:\n    def reset(self, row): raise KeyError('q')\n    def step(self, t): pass", "E", "reset"),
        ("class E:\n    def reset(self, row): return 'hi'\n    def step(self, t): pass", "E", "messages"),
        ("class E:\n    def __init__(self): 1/0\n    reset = step = lambda *a: 0", "E", "ZeroDivisionError"),
    ],
)
def test_plugin_errors_name_the_file(tmp_path, body, attribute, reason):
    path = write_plugin(tmp_path, body)
    with pytest.raises(EnvironmentConfigError, match=reason) as error:
        check_environment(f"{path}:{attribute}", ROW, context())
    assert "my_env.py" in str(error.value)


def test_plugin_file_must_exist(tmp_path):
    with pytest.raises(EnvironmentConfigError, match="does not exist"):
        environment_factory(f"{tmp_path}/nope.py:E")
