"""Hostile programs: each scores 0 (killed at its timeout if it runs on), leaves no process behind, and the next
program still scores.

Expected outputs are unique tokens, so a program that escaped the sandbox (found the test data,
wrote outside its /tmp, reached the network, saw a host file) would print exactly the token and be caught
scoring 1. How long a killed program takes to score is measured in ``benchmarks/bounded_waits.py``, not here.
"""

import os
import socket
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from colossal_rl.reward import build_reward_scorer
from colossal_rl.reward.sandbox import ProgramFiles, Sandbox, SandboxConfig

TIMEOUT_S = 2.0
UID_BASE, UID_COUNT = 62000, 4
TOKEN = f"token-{uuid.uuid4().hex}"
CHECKOUT = Path(__file__).resolve().parents[2]
HOST_PATHS = ("/etc/passwd", "/etc/shadow", "/etc/hostname", "/root", "/home", "/var", str(CHECKOUT))
"""Host paths a program must not see: the host's /etc, home directories and this checkout."""


def fenced(code: str) -> str:
    return f"```python\n{textwrap.dedent(code).strip()}\n```"


def sandbox_leftovers() -> list[str]:
    """Processes of the sandbox uids, or sandbox processes among our descendants."""
    leftovers = []
    for process in psutil.process_iter(["pid", "uids", "cmdline"]):
        uids = process.info["uids"]
        if uids is not None and UID_BASE <= uids.real < UID_BASE + UID_COUNT:
            leftovers.append(f"{process.info['pid']} uid {uids.real}: {process.info['cmdline']}")
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "bwrap" in command or "/sandbox/" in command:
            leftovers.append(f"{child.pid}: {command}")
    return leftovers


@pytest.fixture(scope="module")
def scorer():
    scorer = build_reward_scorer(
        "code",
        timeout_s=TIMEOUT_S,
        max_parallel=2,
        early_stop=False,
        memory_mb=256,
        max_processes=8,
        uid_base=UID_BASE,
        uid_count=UID_COUNT,
    )
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def host_listener():
    """A TCP port listening on the host's loopback: the sandbox must not reach it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    yield server
    server.close()


HOSTILE = {
    "fork_bomb": """
        import os
        while True:
            os.fork()
    """,
    "fork_bomb_resilient": """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
    "subprocess_bomb": """
        import subprocess, sys
        while True:
            try:
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            except OSError:
                pass
    """,
    "double_forked_orphan": """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("bye")
    """,
    "infinite_loop": """
        while True:
            pass
    """,
    "ignores_signals": """
        import signal
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        signal.alarm(1)
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
    """,
    "memory_bomb": """
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))
    """,
    "stdout_flood": """
        import sys
        chunk = "x" * (1 << 20)
        for _ in range(100):
            sys.stdout.write(chunk)
    """,
    "exit_before_printing": """
        import sys
        sys.exit(0)
        print("{token}")
    """,
    "network": """
        import socket
        connection = socket.create_connection(("127.0.0.1", {port}), timeout=1)
        print("{token}")
    """,
    # Prints exactly the token when a host path is visible or a file holding the token (the test data) is
    # readable, else exactly "nothing": its output equals the expected one if and only if the host leaks in.
    "read_host_files": """
        import os
        leaked = any(os.path.exists(p) for p in {host_paths!r})
        for root, dirs, files in os.walk("/"):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/dev", "/usr")]
            for name in files:
                try:
                    with open(os.path.join(root, name), "rb") as handle:
                        leaked = leaked or b"{token}" in handle.read(1 << 20)
                except OSError:
                    pass
        print("{token}" if leaked else "nothing")
    """,
    "write_outside_tmp": """
        import os
        escaped = False
        for path in ("/escape", "/usr/escape", "/sandbox/escape", "/tmp/../escape", "/dev/shm/escape", "{host_file}"):
            try:
                with open(path, "w") as handle:
                    handle.write("x")
                escaped = escaped or not path.startswith("/dev/shm")
            except OSError:
                pass
        with open("/tmp/fine", "w") as handle:
            handle.write("writing in its own /tmp is allowed")
        print("{token}" if escaped else "contained")
    """,
    "overwrite_test_files": """
        import os
        changed = False
        for root in ("/sandbox", "/tmp", "/"):
            for name in os.listdir(root):
                path = os.path.join(root, name)
                if os.path.isfile(path):
                    try:
                        with open(path, "w") as handle:
                            handle.write('print("{token}")')
                        changed = changed or root == "/sandbox"
                    except OSError:
                        pass
        print("{token}" if changed else "unchanged")
    """,
}


def hostile_program(name: str, *, port: int = 0, host_file: Path | str = "/nonexistent") -> str:
    return HOSTILE[name].format(token=TOKEN, port=port, host_file=host_file, host_paths=HOST_PATHS)


class HostMountedSandbox(Sandbox):
    """The positive control: a sandbox that (wrongly) binds the host's /etc and this checkout read-only."""

    def _bwrap_args(self, files: ProgramFiles, status_fd: int) -> list[str]:
        args = super()._bwrap_args(files, status_fd)
        before_remount = args.index("--remount-ro")  # bwrap cannot create mount points once / is read-only
        host = ["--ro-bind", "/etc", "/etc", "--ro-bind", str(CHECKOUT), str(CHECKOUT)]
        return args[:before_remount] + host + args[before_remount:]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program(scorer, host_listener, tmp_path, name):
    host_file = tmp_path / "escaped"
    code = hostile_program(name, port=host_listener.getsockname()[1], host_file=host_file)
    tests = {"inputs": ["1\n", "2\n"], "outputs": [TOKEN] * 2}  # both run, in parallel
    record = scorer.score_batch([fenced(code)], [{"test_cases": tests}])[0]
    assert record.reward == 0.0 and not record.answer_ok, record
    assert record.status in ("ok", "timeout"), record
    assert sandbox_leftovers() == [], f"{name} left processes behind"
    assert not host_file.exists()
    with pytest.raises(TimeoutError):
        host_listener.accept()
    follow_up = scorer.score_batch([fenced("print(input())")], [{"test_cases": {"inputs": ["7"], "outputs": ["7"]}}])
    assert follow_up[0].reward == 1.0, follow_up[0]


@pytest.mark.slow
def test_large_correct_output_passes_while_flood_is_cut(scorer):
    lines = [str(i * 7919 % 100003) for i in range(150_000)]  # ~0.9 MB
    expected = "\n".join(lines) + "\n"
    program = "import sys\nsys.stdout.write(''.join(f'{i * 7919 % 100003}\\n' for i in range(150_000)))"
    record = scorer.score_batch([fenced(program)], [{"test_cases": {"inputs": [""], "outputs": [expected]}}])[0]
    assert record.reward == 1.0, record
    assert len(expected) > 800_000
    flood = scorer.score_batch([fenced(HOSTILE["stdout_flood"])], [{"test_cases": {"inputs": [""], "outputs": ["x"]}}])
    assert flood[0].details["verdicts"] == ["output_limit"]


@pytest.mark.slow
def test_single_hostile_case_is_killed_at_the_timeout(scorer):
    record = scorer.score_batch(
        [fenced(HOSTILE["fork_bomb_resilient"])], [{"test_cases": {"inputs": [""], "outputs": ["1"]}}]
    )[0]
    assert record.status == "timeout" and record.details["verdicts"] == ["timeout"]
    assert sandbox_leftovers() == []


@pytest.mark.slow
def test_tampering_does_not_carry_over_to_later_cases():
    """Cases run one after another: the first tries to rewrite the program and leave files behind."""
    scorer = build_reward_scorer("code", timeout_s=TIMEOUT_S, max_parallel=1, early_stop=False, uid_base=UID_BASE)
    program = hostile_program("overwrite_test_files")
    program += "\nimport os\nif os.path.exists('/tmp/marker'): print('{token}')\nopen('/tmp/marker', 'w').close()"
    try:
        record = scorer.score_batch(
            [fenced(program.format(token=TOKEN))], [{"test_cases": {"inputs": ["", "", ""], "outputs": [TOKEN] * 3}}]
        )[0]
    finally:
        scorer.close()
    assert record.reward == 0.0 and record.details["passed"] == 0, record
    assert sandbox_leftovers() == []


@pytest.mark.slow
def test_sandbox_runs_as_a_dedicated_uid(scorer):
    if os.geteuid() != 0:
        pytest.skip("dedicated uids need root")
    program = f"""
        import os
        uid, gid = os.getuid(), os.getgid()
        print("dedicated" if {UID_BASE} <= uid < {UID_BASE + UID_COUNT} and gid == uid and not os.getgroups() else uid)
    """
    record = scorer.score_batch([fenced(program)], [{"test_cases": {"inputs": [""], "outputs": ["dedicated"]}}])[0]
    assert record.reward == 1.0, record


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sandbox_class", "expected"), [(Sandbox, "nothing"), (HostMountedSandbox, TOKEN)], ids=["real", "host_mounted"]
)
def test_host_files_are_invisible_unless_mounted(sandbox_class, expected):
    """The read_host_files program run directly: "nothing" in the real sandbox; with the host's /etc and the
    checkout bound in (the positive control), exactly the token, so its hostile test would score 1 and fail."""
    sandbox = sandbox_class(SandboxConfig(timeout_s=10.0, uid_base=UID_BASE, uid_count=UID_COUNT))
    assert sandbox.unavailable is None, sandbox.unavailable
    with ProgramFiles(textwrap.dedent(hostile_program("read_host_files"))) as files:
        result = sandbox.run(files, b"")
    assert result.infra_error is None and not result.timed_out, result
    assert result.stdout.decode().strip() == expected, result
