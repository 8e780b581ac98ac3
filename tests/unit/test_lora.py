"""LoRA through peft on a real trainer (world size 1, gloo, the embedded model): what trains, what the weight
sync carries, what producers and the export rebuild from it."""

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.config import ConfigError, ParallelConfig, RLConfig, TrainConfig, replace
from colossal_rl.lora_weights import (
    adapter_state_dict,
    base_name,
    is_adapter_key,
    merge_adapters,
    merged_state_dict,
)

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def trained():
    """A LoRA trainer after two optimizer steps (lora_B starts at zero: the steps make the adapters matter)."""
    from trainer_harness import make_batch, make_config, make_trainer

    trainer = make_trainer(make_config(train=LORA))
    for seed in (0, 1):
        trainer.train_step(make_batch(seed=seed))
    return trainer


def _plain_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(RLConfig().model.path)
    model.load_state_dict(state)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_adapters_train(trained):
    model = trained.engine.unwrapped()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(name) for name in trainable)
    optimized = [p for group in trained.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(trainable)


def test_the_sync_carries_only_adapters_under_5_percent_of_the_model(trained):
    state = trained.stage_state_dict()
    assert state and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    assert trained.sync_report["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert trained.sync_report["weight_sync/fraction_of_full_model"] <= 0.05
    assert any(k.endswith("lora_B.weight") and t.abs().sum() > 0 for k, t in state.items()), "the steps moved B"


# Merged (W0 + s B A) x and unmerged W0 x + s B (A x) differ by fp32 reassociation only: ~2e-5 on these logits
# after two steps at the harness's learning rate 1e-2.
MERGE_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def test_producer_merge_and_the_export_reproduce_the_trained_policy(trained):
    trained_logits = _logits(trained.engine.unwrapped().eval())
    base = _base_weights()
    adapters = trained.stage_state_dict()
    merged = merge_adapters(base, adapters, scaling=LORA["lora_alpha"] / LORA["lora_rank"])  # what producers do
    assert set(merged) == {base_name(key) for key in adapters}
    assert_close(_logits(_plain_model(base | merged)), trained_logits, **MERGE_TOLERANCE)
    exported = trained.full_state_dict()  # what the HF export writes: base names, adapters merged in
    assert not any(is_adapter_key(name) or ".base_layer." in name for name in exported)
    assert_close(_logits(_plain_model(exported)), trained_logits, **MERGE_TOLERANCE)


def _base_weights() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(RLConfig().model.path).state_dict()


def test_adapter_dir_reloads_with_peft(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from colossal_rl.training.trainer import ADAPTER_DIR

    trained.export_model(tmp_path)
    assert (tmp_path / ADAPTER_DIR / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(RLConfig().model.path), tmp_path / ADAPTER_DIR
    )
    assert_close(_logits(reloaded.eval()), _logits(trained.engine.unwrapped().eval()), atol=1e-5, rtol=1e-5)
    assert_close(_logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval()), _logits(reloaded), **MERGE_TOLERANCE)


def test_merge_math_hand_computed():
    base = {"layer.weight": torch.ones(2, 3)}
    adapters = {
        "layer.lora_A.weight": torch.tensor([[1.0, 0.0, 2.0]]),
        "layer.lora_B.weight": torch.tensor([[1.0], [3.0]]),
    }
    merged = merge_adapters(base, adapters, scaling=0.5)
    assert_close(merged["layer.weight"], torch.tensor([[1.5, 1.0, 2.0], [2.5, 1.0, 4.0]]))
    with pytest.raises(KeyError, match="without its lora_B"):
        merge_adapters(base, {"layer.lora_A.weight": adapters["layer.lora_A.weight"]}, 1.0)


def test_state_dict_renaming():
    state = {
        "a.q.base_layer.weight": torch.zeros(2, 2),
        "a.q.base_layer.bias": torch.ones(2),
        "a.q.lora_A.default.weight": torch.ones(1, 2),
        "a.q.lora_B.default.weight": torch.ones(2, 1),
        "norm.weight": torch.ones(2),
    }
    assert set(adapter_state_dict(state)) == {"a.q.lora_A.weight", "a.q.lora_B.weight"}
    plain = merged_state_dict(state, scaling=2.0)
    assert set(plain) == {"a.q.weight", "a.q.bias", "norm.weight"}
    assert_close(plain["a.q.weight"], torch.full((2, 2), 2.0))


def test_lora_with_tensor_or_pipeline_parallelism_is_refused():
    config = replace(RLConfig(), train=TrainConfig(lora_rank=4), parallel=ParallelConfig(num_trainers=2, tp_size=2))
    with pytest.raises(ConfigError, match="LoRA adapters train under DDP and ZeRO only"):
        config.validate()


def test_target_modules_that_match_nothing_are_refused():
    from transformers import AutoModelForCausalLM

    from colossal_rl.training.lora import add_lora_adapters

    model = AutoModelForCausalLM.from_pretrained(RLConfig().model.path)
    with pytest.raises(ValueError, match="no_such_proj"):
        add_lora_adapters(model, TrainConfig(lora_rank=4, lora_target_modules="no_such_proj"))


class TensorParallelEngine:
    """A producer backend over 2 tensor-parallel workers, like ``VllmBackend`` with ``-ptp 2``: no unsharded read."""

    def named_weights(self):
        raise NotImplementedError("named_weights reads one unsharded worker: use -ptp 1 for weight checks")

    def base_weights(self, names):
        from colossal_rl.rollout.vllm_weights import checkpoint_weights

        return checkpoint_weights(RLConfig().model.path, names)


def test_a_lora_sync_merges_into_checkpoint_weights_without_reading_a_tensor_parallel_engine(trained):
    """Issue 33 item 4: the producer's merge used to read the engine's weights, which a -ptp 2 engine refuses."""
    from colossal_rl.rollout.producer import Producer

    producer = Producer.__new__(Producer)
    producer.backend, producer.config, producer._lora_base = TensorParallelEngine(), trained.config, None
    adapters = trained.stage_state_dict()
    merged = producer._merge_adapters(adapters)
    expected = merge_adapters(_base_weights(), adapters, scaling=LORA["lora_alpha"] / LORA["lora_rank"])
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        assert_close(merged[name], tensor)
