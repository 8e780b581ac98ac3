"""Every command in README.md and docs/ copy-pastes and runs.

The ``bash`` blocks of README.md and every docs/ page are read as a shell would (continuation lines joined,
comments dropped, ``&&`` chains split). Each ``python rl_example.py ...`` line runs with ``--print-config``
appended: the whole config is resolved and checked as a run would before Ray starts, then printed. Lines in a
block marked ``<!-- commands: gpu -->`` (GPU or multi-node) run that way too: they must still build a valid config.
The other ``python`` commands (``python -m colossal_rl....``, ``python benchmarks/...``, ``python scripts/...``)
run with ``--help`` appended, which parses the flags written before it; so do such commands quoted inline in
the text (`` `python benchmarks/vs_trl.py` `` in a results table). Installers, ``pytest``, ``ray start`` and
the GPU checks under ``tests/gpu`` are not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root

GPU_MARK = "<!-- commands: gpu -->"
BLOCK = re.compile(r"^(?P<mark>" + re.escape(GPU_MARK) + r"\n)?```bash\n(?P<body>.*?)^```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"`(python (?:-m colossal_rl\.|benchmarks/|scripts/)[^`]*)`")
NOT_RUN = {"pip", "bash", "ray", "git", "export", "env"}
"""Programs whose lines are set-up, not commands of this project."""


@dataclass(frozen=True)
class Command:
    document: str
    argv: tuple[str, ...]
    gpu: bool

    @property
    def id(self) -> str:
        return f"{self.document}: {' '.join(self.argv)[:90]}"


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def commands_in(path: Path) -> list[Command]:
    """The commands of a document's bash blocks, as argv (environment assignments dropped)."""
    found = []
    for block in BLOCK.finditer(path.read_text(encoding="utf-8")):
        for line in block["body"].replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                argv = argv[: next((i for i, word in enumerate(argv) if word in (">", ">>", "|")), len(argv))]
                while argv and re.match(r"^[A-Z_]+=", argv[0]):  # PYTHONPATH=. python ...
                    argv = argv[1:]
                if argv:
                    found.append(Command(str(path.relative_to(REPO_ROOT)), tuple(argv), block["mark"] is not None))
    for span in INLINE.finditer(path.read_text(encoding="utf-8")):
        found.append(Command(str(path.relative_to(REPO_ROOT)), tuple(shlex.split(span[1])), False))
    return found


ALL = [command for path in documents() for command in commands_in(path)]
TRAINING = [c for c in ALL if c.argv[:2] == ("python", "rl_example.py")]


def is_help_command(command: Command) -> bool:
    argv = command.argv
    if argv[0] != "python" or argv[1] == "rl_example.py" or command.gpu:
        return False
    if argv[1] == "-m":
        return argv[2].startswith("colossal_rl")
    return argv[1].startswith(("benchmarks/", "scripts/"))


HELP = sorted({c.argv: c for c in ALL if is_help_command(c)}.values(), key=lambda c: c.argv)


def test_the_documents_hold_the_commands_this_test_is_for():
    assert len(TRAINING) >= 20, [c.id for c in TRAINING]
    readme = [c.argv for c in ALL if c.document == "README.md"]
    assert ("python", "rl_example.py") in readme and ("python", "-m", "pytest") in readme
    assert any(c.gpu for c in TRAINING) and any(not c.gpu for c in TRAINING)
    assert {c.argv[1] for c in HELP} >= {"-m", "benchmarks/weight_sync.py"}
    others = {c.argv[0] for c in ALL if c.argv[0] != "python"}
    assert others <= NOT_RUN, f"commands of a program this test does not know how to check: {others - NOT_RUN}"


@pytest.mark.parametrize("command", TRAINING, ids=lambda c: c.id)
def test_every_training_command_builds_a_valid_config(command, monkeypatch, capsys):
    from rl_example import main

    monkeypatch.chdir(REPO_ROOT)
    assert main([*command.argv[2:], "--print-config"]) == 0, capsys.readouterr().err[-2000:]
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {"model", "data", "algorithm", "train", "run"} <= set(printed)


HELP_RUNNER = """
import contextlib, io, json, os, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = [argv[0] if argv[0] != "-m" else argv[1], *argv[(2 if argv[0] == "-m" else 1):], "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if argv[0] == "-m":
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # as `python script.py` would: the script's directory first on the path
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                try:
                    runpy.run_path(argv[0], run_name="__main__")
                finally:
                    sys.path.pop(0)
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    except BaseException as error:
        code, out = 1, io.StringIO(out.getvalue() + repr(error))
    if code == 0 and "usage:" not in out.getvalue():
        code = "no usage: line"
    results.append([code, out.getvalue()[-800:]])
print(json.dumps(results))
"""
"""Runs each command's ``--help`` in one interpreter (each script as ``__main__``), so the stack is imported once."""


def script_of(command: Command) -> Path:
    """The file a help command runs; it must have a parser (without one, ``--help`` would run it)."""
    argv = command.argv
    source = Path(importlib.util.find_spec(argv[2]).origin) if argv[1] == "-m" else REPO_ROOT / argv[1]
    assert source.is_file(), f"{command.id}: no {source}"
    assert "argparse" in source.read_text(encoding="utf-8"), f"{command.id}: {source} takes no --help"
    return source


def test_every_other_python_command_accepts_its_flags_and_help():
    for command in HELP:
        script_of(command)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    argvs = [list(command.argv[1:]) for command in HELP]
    done = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, json.dumps(argvs)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {c.id: (code, output) for c, (code, output) in zip(HELP, results, strict=True) if code != 0}
    assert not failed, failed
