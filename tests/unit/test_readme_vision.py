"""The vision-language guide (docs/guides/vision.md): its CPU command runs the embedded tiny VLM on its shapes task (the command
``tests/e2e/test_vision_e2e.py`` and ``benchmarks/vision_learning.py`` run), and its GPU command line builds a
valid config that fills one 8-GPU node."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from colossal_rl.driver.placement import NodeInfo, plan_placement
from colossal_rl.rollout import backend as backend_module

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from rl_example import build_parser, config_from_args  # noqa: E402

PAGE = REPO_ROOT / "docs" / "guides" / "vision.md"


def commands() -> list[list[str]]:
    section = PAGE.read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)).replace("\\\n", " ")
    return [shlex.split(line)[2:] for line in blocks.splitlines() if line.startswith("python rl_example.py")]


def test_the_cpu_command_trains_the_embedded_vlm_on_the_shapes_task(monkeypatch):
    from colossal_rl.config import EMBEDDED_SHAPES_EVAL_DATA, EMBEDDED_SHAPES_TRAIN_DATA, EMBEDDED_VLM_DIR

    monkeypatch.chdir(REPO_ROOT)
    cpu, _ = commands()
    config = config_from_args(build_parser().parse_args(cpu)).validate()
    assert config.generation.backend == "transformers" and config.reward.reward_type == "boxed"
    assert Path(config.model.path).resolve() == EMBEDDED_VLM_DIR
    assert Path(config.data.train_path).resolve() == EMBEDDED_SHAPES_TRAIN_DATA
    assert [(task, Path(path).resolve()) for task, path in config.data.eval_paths] == [
        ("shapes", EMBEDDED_SHAPES_EVAL_DATA)
    ]
    assert (config.generation.max_new_tokens, config.schedule.max_steps, config.run.eval_interval) == (12, 30, 10)


def test_the_gpu_command_builds_a_valid_config_that_fills_a_node(monkeypatch):
    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    _, gpu = [config_from_args(build_parser().parse_args(argv)) for argv in commands()]
    assert (gpu.generation.backend, gpu.data.prompt_key, gpu.data.image_key) == ("vllm", "problem", "images")
    assert gpu.train.freeze_vision_tower and gpu.data.limit_images == 1 and gpu.data.max_pixels == 1003520
    assert gpu.validate() is gpu and gpu.model.path == "Qwen/Qwen2.5-VL-3B-Instruct"
    placement = plan_placement(
        [NodeInfo("node0", "10.0.0.1", 64, 8, is_head=True)],
        num_producers=gpu.schedule.num_producers,
        producer_gpus=gpu.generation.tensor_parallel_size,
        num_trainers=gpu.parallel.num_trainers,
    )
    assert sum(actor.num_gpus for actor in placement.producers + placement.trainers) == 8
