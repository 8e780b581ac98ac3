"""Worker process of :mod:`colossal_rl.reward.bounded_calls`: ``python -m colossal_rl.reward.bounded_worker
FACTORY SPEC PARENT_PID``.

Loads the function once (``FACTORY`` is ``module:function``, called with ``SPEC``), says ``ready``, then answers one
call at a time: pickled argument tuples on stdin, pickled ``("ok", value)`` or ``("raised", message)`` on stdout. It
has no time limit of its own: its parent kills it. It dies with its parent (``PR_SET_PDEATHSIG`` and a watch on the
parent's pid) and exits when stdin closes. Anything the function prints goes to stderr, never into the replies.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
from multiprocessing.connection import Connection

from .worker_lifetime import die_with_parent

SYS_PATH_VARIABLE = "COLOSSAL_RL_BOUNDED_WORKER_SYS_PATH"
"""Set by the parent (``bounded_calls.py``): its ``sys.path``, as JSON."""


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:1000]


def main() -> None:
    factory, spec, parent_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    die_with_parent(parent_pid)
    requests = Connection(os.dup(0), writable=False)
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # prints, the function's and C extensions' alike, go to stderr
    sys.stdout = sys.stderr
    sys.path[:0] = [entry for entry in json.loads(os.environ.get(SYS_PATH_VARIABLE, "[]")) if entry not in sys.path]
    try:
        module_name, _, name = factory.partition(":")
        function = getattr(importlib.import_module(module_name), name)(spec)
    except Exception as error:
        replies.send(("failed", f"loading {spec} failed: {_describe(error)}"))
        return
    replies.send(("ready", None))
    while True:
        try:
            arguments = requests.recv()
        except EOFError:
            return
        try:
            reply = pickle.dumps(("ok", function(*arguments)))
        except Exception as error:  # raised, or returned something that cannot be pickled
            reply = pickle.dumps(("raised", _describe(error)))
        replies.send_bytes(reply)


if __name__ == "__main__":
    main()
