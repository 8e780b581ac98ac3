"""A Python interpreter tool, run in the project's code sandbox (``colossal_rl.reward.sandbox``).

Every call is one fresh sandboxed process (bubblewrap: no network, no host files but a read-only Python runtime,
a private size-capped /tmp, a dedicated uid when we are root, rlimits on CPU, memory, processes, file size),
killed at its wall-clock limit; its stdout past ``max_output_bytes`` kills it too. Nothing it does can raise
here: a timeout, an output flood, a crash or a sandbox that cannot start all become the error text the policy
reads. Calls share nothing: state does not carry over from one call to the next.
"""

from __future__ import annotations

import functools
from typing import Any

from colossal_rl.environments.base import EnvironmentContext
from colossal_rl.environments.scored import ToolEnvironment
from colossal_rl.environments.tool_calls import Tool, ToolError
from colossal_rl.reward.sandbox import ProgramFiles, RunResult, Sandbox, SandboxConfig

DEFAULT_LIMITS = {"timeout_s": 5.0, "memory_mb": 256, "max_processes": 4, "max_output_bytes": 16 * 1024}
"""The tool's sandbox limits unless ``--env-option`` (the context's options) says otherwise."""
MAX_CODE_CHARS = 20_000
_STDERR_TAIL = 1500


@functools.cache
def shared_sandbox(config: SandboxConfig) -> Sandbox:
    """One sandbox per configuration and process (finding bwrap and a runtime takes a moment)."""
    return Sandbox(config)


def sandbox_config(options: dict[str, Any]) -> SandboxConfig:
    """The tool's limits: :data:`DEFAULT_LIMITS` overridden by any :class:`SandboxConfig` field in ``options``."""
    return SandboxConfig(**{**DEFAULT_LIMITS, **options})


def run_python(sandbox: Sandbox, code: str) -> str:
    """What running ``code`` printed; raises :class:`ToolError` saying why it did not finish cleanly."""
    if len(code) > MAX_CODE_CHARS:
        raise ToolError(f"code longer than {MAX_CODE_CHARS} characters")
    with ProgramFiles(code) as files:
        result = sandbox.run(files, b"")
    return describe(result, sandbox.config)


def describe(result: RunResult, config: SandboxConfig) -> str:
    """The observation for one run: its output, or the error (timeout, output limit, exit status, traceback)."""
    if result.infra_error:
        raise ToolError(f"the Python sandbox failed: {result.infra_error[:500]}")
    if result.timed_out:
        raise ToolError(f"the program ran longer than {config.timeout_s:g} s and was stopped")
    if result.output_limited:
        raise ToolError(f"the program printed more than {config.max_output_bytes} bytes and was stopped")
    stdout = result.stdout.decode("utf-8", errors="replace")
    if result.exit_code != 0:
        stderr = result.stderr.decode("utf-8", errors="replace")[-_STDERR_TAIL:]
        raise ToolError(f"the program exited with status {result.exit_code}\n{stdout}{stderr}".rstrip())
    return stdout if stdout.strip() else "(no output: print what you want to see)"


def python_tool(sandbox: Sandbox) -> Tool:
    return Tool(
        name="python",
        description="Run a Python 3 program (standard library only, no network, no files kept) and see its output.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print what you need"}},
            "required": ["code"],
        },
        run=lambda arguments: run_python(sandbox, _code(arguments)),
    )


def _code(arguments: dict[str, Any]) -> str:
    code = arguments["code"]
    if not isinstance(code, str):
        raise ToolError("code must be a string")
    return code


class PythonEnvironment(ToolEnvironment):
    """``--env python``: the policy may run Python in the sandbox, then answers; scored by the run's reward."""

    def __init__(self, context: EnvironmentContext):
        super().__init__(context, [python_tool(shared_sandbox(sandbox_config(context.options)))])
