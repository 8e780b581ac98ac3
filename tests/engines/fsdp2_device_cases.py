"""Devices and dtypes of the FSDP2 engine, checked on the CPU (issue 55, item 7): what a GPU run would get wrong.

Run in the producers' environment (torch 2.13: its FSDP2 runs on the CPU; torch 2.5.1's needs CUDA streams) by
``test_fsdp2_devices_and_dtypes.py``; not collected in the trainers' environment (the name has no ``test_`` prefix).

- bf16 on the CPU through the engine, as on a GPU (``MixedPrecisionPolicy`` works on the CPU): the policy loads in
  fp32, the sharded parameters and the optimizer state stay fp32, every decoder block computes in bf16, the full state
  dict comes back bf16 on the host and equals the shards cast; fp32 keeps fp32 throughout. On tiny random qwen2,
  llama, olmo3 and qwen3_moe models, whose decoder blocks the engine finds without being told their names.
- A fake GPU (``torch.cuda.is_available``/``current_device`` patched): ``auto`` precision is bf16, ``device()`` is the
  current GPU, and the trainer asks for NCCL (``init_process_group`` recorded, not run).
- The device mesh is built on the policy's device (a policy on the ``meta`` device: the mesh's type is recorded).

Each assertion was seen to fail with the mistake it names (see the runner's docstring).
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from colossal_rl.config import RLConfig, replace
from colossal_rl.training.engines.base import PolicyTraits
from colossal_rl.training.engines.fsdp2_engine import FSDP2Engine, decoder_blocks

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch 2.5
    from torch.distributed._composable.fsdp import FSDPModule

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ARCHITECTURES = {
    "qwen2": {},
    "llama": {},
    "olmo3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """The engine's own CPU process group, world size 1 (gloo over a TCPStore)."""
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    engine = FSDP2Engine(RLConfig())
    engine.start_process_group(0, 1, store, on_cpu=True, timeout_s=60)
    assert dist.get_backend() == "gloo"
    yield
    dist.destroy_process_group()


def engine_for(precision: str) -> FSDP2Engine:
    config = RLConfig()
    return FSDP2Engine(replace(config, parallel=replace(config.parallel, precision=precision, trainer_backend="fsdp2")))


def tiny_model(model_type: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **ARCHITECTURES[model_type])
    return AutoModelForCausalLM.from_config(config).to(dtype)


def wrapped(engine: FSDP2Engine, model_type: str) -> torch.nn.Module:
    model = tiny_model(model_type, engine.load_dtype(engine.compute_dtype))
    engine.wrap(
        model,
        PolicyTraits(mixture_of_experts=model_type.endswith("moe")),
        lambda parameters: torch.optim.AdamW(parameters, lr=1e-3),
        lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    return model


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_decoder_blocks_are_found_without_their_names(model_type):
    model = tiny_model(model_type, torch.float32)
    assert decoder_blocks(model) == list(model.model.layers)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
@pytest.mark.parametrize("precision", list(DTYPES))
def test_shards_stay_fp32_blocks_compute_in_the_precision_full_weights_come_back_in_it(precision, model_type):
    engine = engine_for(precision)
    compute_dtype = DTYPES[precision]
    assert engine.compute_dtype == compute_dtype and engine.load_dtype(compute_dtype) == torch.float32
    model = wrapped(engine, model_type)
    blocks = list(model.model.layers)
    assert all(isinstance(block, FSDPModule) for block in blocks)  # each block sharded on its own
    parameters = dict(model.named_parameters())
    assert {(type(p).__name__, p.dtype, p.device.type) for p in parameters.values()} == {
        ("DTensor", torch.float32, "cpu")
    }
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in parameters.values()}  # the optimizer holds the shards, not the loaded tensors

    block_outputs = []
    hooks = [
        block.register_forward_hook(lambda module, args, out: block_outputs.append((out[0] if isinstance(out, tuple)
                                                                                     else out).dtype))
        for block in blocks
    ]  # fmt: skip
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=input_ids).logits
    loss = torch.log_softmax(logits.float(), -1)[..., 0].mean()
    engine.backward(loss)
    for hook in hooks:
        hook.remove()
    assert block_outputs == [compute_dtype] * len(blocks)
    assert {(p.grad.dtype, p.grad.device.type) for p in parameters.values()} == {(torch.float32, "cpu")}

    norm = engine.optimizer_step(max_norm=1.0)
    assert norm is not None and torch.isfinite(torch.tensor(norm)) and norm > 0
    states = [value for state in engine.optimizer.state.values() for value in state.values() if value.dim() > 0]
    assert states and {(s.dtype, s.device.type) for s in states} == {(torch.float32, "cpu")}
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    full = engine.full_state_dict()
    assert set(parameters) <= set(full)
    assert {(t.dtype, t.device.type) for t in full.values()} == {(compute_dtype, "cpu")}
    for name, parameter in parameters.items():
        assert torch.equal(full[name], parameter.full_tensor().to(compute_dtype)), name


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports a CUDA device (number 3, as a Ray actor's current device may be) without one being there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_on_a_gpu_auto_precision_is_bf16_and_the_device_is_the_current_gpu(fake_gpu):
    engine = FSDP2Engine(RLConfig())
    assert engine.compute_dtype == torch.bfloat16 and engine.load_dtype(torch.bfloat16) == torch.float32
    assert engine.device() == torch.device("cuda", 3)


def test_on_the_cpu_auto_precision_is_fp32_and_the_device_is_the_host():
    engine = FSDP2Engine(RLConfig())
    assert engine.compute_dtype == torch.float32 and engine.device() == torch.device("cpu")


@pytest.mark.parametrize("on_gpu", [True, False])
def test_the_trainer_asks_for_nccl_on_a_gpu_and_gloo_on_the_cpu(monkeypatch, request, on_gpu):
    """Through ``Trainer.setup``, as a Ray trainer starts: the call to ``init_process_group`` is recorded, not run."""
    from colossal_rl.training.trainer import Trainer

    if on_gpu:
        request.getfixturevalue("fake_gpu")
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(Trainer, "build", lambda self, engine=None: calls.append({"built_with": type(engine)}))
    config = RLConfig()
    config = replace(config, parallel=replace(config.parallel, trainer_backend="fsdp2"))
    trainer = Trainer(0, 1, config, "127.0.0.1", 0)
    port = trainer.host_rendezvous()
    trainer.setup()
    (started, built) = calls
    assert started["backend"] == ("nccl" if on_gpu else "gloo")
    assert (started["rank"], started["world_size"]) == (0, 1) and started["store"].port == port
    assert started["timeout"] == datetime.timedelta(seconds=config.run.timeout_s)
    assert built == {"built_with": FSDP2Engine}
    assert trainer.config.parallel.precision == ("bf16" if on_gpu else "fp32")


def test_the_device_mesh_is_built_on_the_policy_device(monkeypatch):
    """A policy on another device than the host (``meta`` here, a GPU in a run): the mesh must be of that device."""
    import torch.distributed.device_mesh

    class Recorded(Exception):
        pass

    def record(device_type, mesh_shape, **kwargs):
        raise Recorded(device_type, tuple(mesh_shape))

    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh", record)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **TINY))
    with pytest.raises(Recorded) as recorded:
        engine_for("bf16").wrap(model, PolicyTraits(), torch.optim.AdamW, lambda optimizer: None)
    assert recorded.value.args == ("meta", (1,))
