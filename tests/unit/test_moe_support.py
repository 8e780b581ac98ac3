"""What an MoE policy trains under, and what routing replay takes: refused before Ray starts, in one line naming
the flag (``moe/support.py`` through ``input_checks.check_mixture_of_experts``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from colossal_rl.config import EMBEDDED_MODEL_DIR, ModelConfig, ParallelConfig, RLConfig
from colossal_rl.input_checks import InputError, check_mixture_of_experts
from colossal_rl.moe.support import is_moe_config, moe_refusal

QWEN3_MOE = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}


def refusal(model_json=QWEN3_MOE, **changes):
    settings = dict(model="m", tp_size=1, pp_size=1, routing_replay=True, backend="transformers",
                    continuous_batching=False, environment=None) | changes  # fmt: skip
    return moe_refusal(model_json, **settings)


def test_a_qwen3_moe_trains_with_replay_on_the_transformers_backend_under_ddp_or_zero():
    assert refusal() is None
    assert refusal(routing_replay=False) is None
    assert refusal(routing_replay=False, backend="vllm") is None  # vLLM serves it and takes its weight syncs
    assert refusal(lora_rank=8) is None
    assert is_moe_config(QWEN3_MOE) and not is_moe_config({"model_type": "qwen2"}) and not is_moe_config(None)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"tp_size": 2}, "-tp 2 -pp 1: ColossalAI 0.5.0's shardformer has no policy for qwen3_moe"),
        ({"pp_size": 2, "routing_replay": False}, "-tp 1 -pp 2"),
        ({"backend": "vllm"}, "--routing-replay with -b vllm"),
        ({"backend": "vllm", "routing_replay": False, "lora_rank": 8}, "--lora-rank with -b vllm"),
        ({"continuous_batching": True}, "--routing-replay with --continuous-batching"),
        ({"environment": "calculator"}, "--routing-replay with --env calculator"),
    ],
)
def test_what_cannot_work_is_refused_naming_the_flag(changes, named):
    message = refusal(**changes)
    assert message is not None and message.startswith(named) and "\n" not in message


def test_replay_on_a_dense_model_and_an_unknown_moe_are_refused_and_an_unknown_moe_trains_without_them():
    assert refusal({"model_type": "qwen2"}).startswith("--routing-replay: -m/--model m is not a mixture-of-experts")
    glm = {"model_type": "glm4_moe", "n_routed_experts": 8}
    assert refusal(glm).startswith("--routing-replay: it hooks the MoE blocks of qwen3_moe")
    assert "'glm4_moe' mixture of experts" in refusal(glm, routing_replay=False, router_aux_loss_coef=0.01)
    assert refusal(glm, routing_replay=False) is None  # any mixture of experts trains (no replay, no balance loss)
    assert refusal({"model_type": "qwen2"}, routing_replay=False, router_aux_loss_coef=0.01).startswith(
        "--router-aux-loss-coef 0.01: -m/--model m is not a mixture-of-experts"
    )


def test_the_input_check_reads_the_models_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    config = RLConfig(model=ModelConfig(path=str(tmp_path), routing_replay=True))
    check_mixture_of_experts(config)
    with pytest.raises(InputError, match="-tp 2 -pp 1"):
        check_mixture_of_experts(dataclasses.replace(config, parallel=ParallelConfig(num_trainers=2, tp_size=2)))
    with pytest.raises(InputError, match="not a mixture-of-experts model"):
        check_mixture_of_experts(RLConfig(model=ModelConfig(path=str(EMBEDDED_MODEL_DIR), routing_replay=True)))


def test_the_readme_and_guide_commands_train_the_embedded_moe_with_replay(monkeypatch):
    """README's mixture-of-experts command (its "More" list) and the guide's (the second is the one
    ``tests/e2e/test_moe_e2e.py`` runs, cut to 10 steps) build valid configs on the embedded tiny Qwen3-MoE."""
    import re
    import shlex
    import sys
    from pathlib import Path

    from colossal_rl.config import EMBEDDED_MOE_DIR

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from rl_example import build_parser, config_from_args

    monkeypatch.chdir(root)
    readme = (root / "README.md").read_text()
    section = readme[readme.index("### More") : readme.index("## Results")]
    guide = (root / "docs" / "guides" / "mixture-of-experts.md").read_text()
    lines = re.findall(r"`(python rl_example.py -m colossal_rl/assets/tiny_qwen3_moe[^`]*)`", section) + [
        line
        for line in "\n".join(re.findall(r"```bash\n(.*?)```", guide.split("## Why")[0], flags=re.DOTALL)).splitlines()
        if line.startswith("python rl_example.py")
    ]
    assert len(lines) == 3
    for line in lines:
        config = config_from_args(build_parser().parse_args(shlex.split(line)[2:])).validate()
        assert Path(config.model.path).resolve() == EMBEDDED_MOE_DIR and config.model.routing_replay
        check_mixture_of_experts(config)
    zero = config_from_args(build_parser().parse_args(shlex.split(lines[2])[2:])).validate()
    assert (zero.parallel.num_trainers, zero.parallel.zero_stage) == (2, 1)
