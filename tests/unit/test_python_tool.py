"""The Python tool runs policy code in the code sandbox: it sees nothing of the host, and a program that hangs,
floods its output or crashes becomes an error observation, never a crash or a hang of the episode."""

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from colossal_rl.environments import EnvironmentContext, environment_factory
from colossal_rl.reward.user_functions import PluginScorer

TOKEN = f"secret-{uuid.uuid4().hex}"
LIMITS = {"timeout_s": 2.0, "memory_mb": 256, "max_output_bytes": 4096, "uid_base": 63000, "uid_count": 4}


def run(env, code: str) -> str:
    turn = f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"
    result = env.step(turn)
    assert not result.done and result.reward is None and len(result.observation) == 1
    return result.observation[0]["content"]


@pytest.fixture(scope="module")
def env():
    context = EnvironmentContext(reward_scorer=PluginScorer(lambda r, row: 0.0, "zero"), options=LIMITS)
    environment = environment_factory("python")(context)
    environment.reset({"messages": {"role": "user", "content": "hi"}})
    yield environment
    environment.close()


@pytest.fixture(scope="module")
def host_secret():
    """A file in this checkout and an environment variable of this process, both holding the token."""
    path = Path(__file__).resolve().parent / f".host_secret_{uuid.uuid4().hex}"
    path.write_text(TOKEN)
    os.environ["COLOSSAL_RL_TEST_SECRET"] = TOKEN
    yield path
    path.unlink()
    del os.environ["COLOSSAL_RL_TEST_SECRET"]


def test_runs_a_program_and_returns_what_it_printed(env):
    assert run(env, "print(sum(range(10)))").strip() == "45"


def test_a_program_sees_neither_host_files_nor_environment(env, host_secret):
    program = f"""
import os
print(os.environ.get("COLOSSAL_RL_TEST_SECRET"))
for path in ({str(host_secret)!r}, "/etc/passwd", "/root", "/home"):
    try:
        print(open(path).read()[:100])
    except OSError as error:
        print("denied", path, type(error).__name__)
print(sorted(os.environ))
"""
    seen = run(env, program)
    assert TOKEN not in seen and "COLOSSAL_RL_TEST_SECRET" not in seen
    assert f"denied {host_secret}" in seen and "denied /etc/passwd" in seen and "root:" not in seen


def test_a_hanging_program_is_stopped_and_reported(env):
    started = time.monotonic()
    seen = run(env, "while True:\n    pass")
    assert "ran longer than 2 s" in seen
    assert time.monotonic() - started < 15


def test_a_flooding_program_is_stopped_and_reported(env):
    seen = run(env, "while True:\n    print('x' * 1000)")
    assert "printed more than 4096 bytes" in seen and len(seen) < 500


def test_a_crash_shows_its_traceback_and_the_next_call_still_works(env):
    seen = run(env, "print('before')\nraise ValueError('bad input')")
    assert "exited with status 1" in seen and "before" in seen and "ValueError: bad input" in seen
    assert run(env, "print(2 ** 10)").strip() == "1024"


def test_calls_share_no_state(env):
    run(env, "open('/tmp/note', 'w').write('kept?')")
    assert "FileNotFoundError" in run(env, "print(open('/tmp/note').read())")
