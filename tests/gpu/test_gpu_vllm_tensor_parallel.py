"""A tensor-parallel vLLM engine (2 GPUs) takes new weights into every worker's shard, and its behaviour
log-probabilities are those of the new weights.

Needs 2 CUDA GPUs and the gpu extra; skipped without CUDA (``tests/conftest.py``). Written for GPU machines;
not run on the CPU-only CI. The engine lives in the test process, so this file should run after the Ray tests.

The engine runs in float32: with ``dtype="auto"`` vLLM 0.7.3 runs the embedded model's float32 config in float16
(checked on CPU against the real package: ``vllm.EngineArgs(...).create_model_config().dtype``), and the exact
weight comparison and the float32 log-prob tolerance below hold only at the trainers' precision. vLLM serves
float32 with its xformers attention backend (FlashAttention takes fp16/bf16 only).
"""

from __future__ import annotations

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR, VllmEngineConfig
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.vllm_weights import from_vllm_weights, named_weights_on_worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TENSOR_PARALLEL = 2


def unshard(per_worker: list[dict[str, torch.Tensor]], hf_config, tp: int) -> dict[str, torch.Tensor]:
    """One unsharded vLLM state (fused names) from the shards of ``tp`` workers (vLLM's Qwen2/Llama layout)."""
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    assert hf_config.num_key_value_heads % tp == 0, "KV heads replicated across workers: not handled here"
    q_size = hf_config.num_attention_heads * head_dim // tp
    kv_size = hf_config.num_key_value_heads * head_dim // tp
    full: dict[str, torch.Tensor] = {}
    for name in per_worker[0]:
        shards = [worker[name] for worker in per_worker]
        if ".qkv_proj." in name:  # each worker holds [its q heads, its k heads, its v heads]
            parts = [shard.split([q_size, kv_size, kv_size]) for shard in shards]
            full[name] = torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
        elif ".gate_up_proj." in name:  # each worker holds [its gate rows, its up rows]
            halves = [shard.chunk(2) for shard in shards]
            full[name] = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: split along inputs
            full[name] = torch.cat(shards, dim=1)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # vocab-parallel: split along rows
            full[name] = torch.cat(shards)
        else:  # norms: replicated
            assert all(torch.equal(shard, shards[0]) for shard in shards), name
            full[name] = shards[0]
    return full


@pytest.fixture(scope="module")
def tensor_parallel_backend():
    pytest.importorskip("vllm")
    if torch.cuda.device_count() < TENSOR_PARALLEL:
        pytest.skip(f"needs {TENSOR_PARALLEL} GPUs")
    from colossal_rl.rollout.vllm_backend import VllmBackend

    return VllmBackend(
        str(EMBEDDED_MODEL_DIR),
        tensor_parallel_size=TENSOR_PARALLEL,
        engine=VllmEngineConfig(gpu_memory_utilization=0.3),
        max_sequence_tokens=256,
        dtype="float32",  # the precision of perturbed_model(), which the checks compare against
    )


def perturbed_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # tied embeddings are one parameter: they stay tied
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def test_every_tensor_parallel_shard_takes_the_new_weights(tensor_parallel_backend):
    backend = tensor_parallel_backend
    model = perturbed_model()
    new_state = {name: tensor.cuda() for name, tensor in model.state_dict().items()}
    backend.load_weights(new_state)

    per_worker = backend.llm.collective_rpc(named_weights_on_worker)
    assert len(per_worker) == TENSOR_PARALLEL
    held = from_vllm_weights(unshard(per_worker, backend.hf_config, TENSOR_PARALLEL), backend.hf_config)
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name:
            continue
        assert torch.equal(held[name].float(), tensor), name


def test_behaviour_logprobs_are_those_of_the_new_weights(tensor_parallel_backend):
    backend = tensor_parallel_backend
    model = perturbed_model()
    backend.load_weights({name: tensor.cuda() for name, tensor in model.state_dict().items()})
    prompts = [backend.tokenizer("12+34=")["input_ids"], backend.tokenizer("7+8=")["input_ids"]]
    sampling = SamplingSettings(temperature=0.9, max_new_tokens=8)
    output = backend.generate(prompts, 3, sampling)

    assert output.response_ids.shape[0] == 6 and len(output.responses) == 6
    for row in range(6):  # group-major, left-padded prompts
        prompt = output.prompt_ids[row][output.prompt_mask[row].bool()].tolist()
        assert prompt == prompts[row // 3]
        length = int(output.response_mask[row].sum())
        ids = torch.tensor([prompt + output.response_ids[row, :length].tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / sampling.temperature
        expected = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        torch.testing.assert_close(output.behaviour_logprobs[row, :length], expected, atol=2e-3, rtol=0)
