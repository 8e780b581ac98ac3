"""The tool guide (docs/guides/tools.md): its CPU command trains the embedded tool-calling model on its arithmetic task
through the calculator environment, the command ``benchmarks/tool_learning.py`` measures and
``tests/e2e/test_tool_calling_e2e.py`` runs (shortened)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

from test_tool_calling_e2e import readme_command  # noqa: E402

from benchmarks.tool_learning import FLAGS  # noqa: E402
from colossal_rl.config import (  # noqa: E402
    EMBEDDED_ARITHMETIC_EVAL_DATA,
    EMBEDDED_ARITHMETIC_TRAIN_DATA,
    EMBEDDED_TOOL_MODEL_DIR,
)
from colossal_rl.input_checks import check_inputs  # noqa: E402
from rl_example import build_parser, config_from_args  # noqa: E402


def test_the_command_runs_the_calculator_environment_on_the_embedded_tool_model(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    argv = readme_command()
    config = config_from_args(build_parser().parse_args(argv)).validate()
    assert config.environment.name == "calculator" and config.generation.backend == "transformers"
    assert Path(config.model.path).resolve() == EMBEDDED_TOOL_MODEL_DIR
    assert Path(config.data.train_path).resolve() == EMBEDDED_ARITHMETIC_TRAIN_DATA
    assert [(task, Path(path).resolve()) for task, path in config.data.eval_paths] == [
        ("arithmetic", EMBEDDED_ARITHMETIC_EVAL_DATA)
    ]
    assert (config.environment.max_turns, config.environment.max_total_tokens) == (3, 128)
    assert (config.generation.max_new_tokens, config.schedule.max_steps, config.run.eval_interval) == (40, 16, 8)
    check_inputs(config)  # the environment opens an episode on the first row before Ray would start


def test_the_benchmark_measures_the_readme_command():
    argv = readme_command()
    for flag, value in zip(FLAGS[::2], FLAGS[1::2], strict=True):
        assert argv[argv.index(flag) + 1] == value, flag
