"""What a mixture-of-experts policy can be trained with here, and what routing replay needs, as one-line refusals.

Read before Ray starts (``input_checks.py``) from the model's config.json, so a run that cannot work costs
seconds. Torch-free.

- **Trained under** the plugins that take any model: DDP (``-t N``) and ZeRO 1/2 (``--zero-stage``). ColossalAI
  0.5.0's shardformer has MoE policies for Mixtral and DeepSeek only (and its MoE hybrid plugin's expert
  parallelism only for those): tensor and pipeline parallelism of a Qwen3-MoE are refused, and there is no
  expert-parallel flag.
- **Routing replay** (``--routing-replay``) records choices in the transformers backend's sampling forward
  (``rollout/decoding.py``); single-turn rollouts only, without the continuous batcher (whose decode loop does not
  record yet).
- **Producers** on either backend: vLLM 0.32 serves Qwen3-MoE, and the weight sync maps the per-expert weights onto
  its fused expert parameters (``rollout/vllm_weights.py``). Refused there: routing replay
  (``VLLM_REPLAY_REFUSAL``) and LoRA (``VLLM_MOE_LORA_REFUSAL``).
"""

from __future__ import annotations

from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe",)
"""``model_type`` values of the MoE architectures we replay and give the balance loss (``moe/blocks.py``'s blocks);
any other mixture of experts trains without those two."""

VLLM_REPLAY_REFUSAL = (
    "--routing-replay with -b vllm: vLLM 0.32 returns routed experts only from its V2 model runner, which needs a "
    "Triton with a CPU backend that the CPU wheels do not have; use -b transformers (the default) for routing replay"
)
"""vLLM 0.32 itself serves a Qwen3-MoE on CPU (greedy tokens equal transformers'), and our weight sync reaches its
fused experts (``rollout/vllm_weights.py``); its routed-experts output is what is missing here."""
VLLM_MOE_LORA_REFUSAL = (
    "--lora-rank with -b vllm and a mixture-of-experts policy: a LoRA sync merges only the adapted layers, and vLLM "
    "rebuilds a fused expert layer whole, so the experts it does not send would be lost; use -b transformers"
)


def is_moe_config(model_json: dict[str, Any] | None) -> bool:
    """Whether a model's config.json describes a mixture of experts (any architecture with experts)."""
    if not model_json:
        return False
    return model_json.get("model_type") in MOE_MODEL_TYPES or bool(
        model_json.get("num_experts") or model_json.get("num_local_experts") or model_json.get("n_routed_experts")
    )


def moe_refusal(
    model_json: dict[str, Any] | None,
    *,
    model: str,
    tp_size: int,
    pp_size: int,
    routing_replay: bool,
    backend: str,
    continuous_batching: bool,
    environment: str | None,
    router_aux_loss_coef: float = 0.0,
    lora_rank: int = 0,
) -> str | None:
    """Why this run cannot train ``model`` (its config.json ``model_json``) as configured; None if it can."""
    moe = is_moe_config(model_json)
    not_moe = f"-m/--model {model} is not a mixture-of-experts model (no experts in its config.json)"
    if routing_replay and not moe:
        return f"--routing-replay: {not_moe}"
    if router_aux_loss_coef > 0 and not moe:
        return f"--router-aux-loss-coef {router_aux_loss_coef:g}: {not_moe}"
    if not moe:
        return None
    model_type = (model_json or {}).get("model_type")
    if model_type not in MOE_MODEL_TYPES and (routing_replay or router_aux_loss_coef > 0):
        flag = "--routing-replay" if routing_replay else f"--router-aux-loss-coef {router_aux_loss_coef:g}"
        return (
            f"{flag}: it hooks the MoE blocks of {', '.join(MOE_MODEL_TYPES)}; -m/--model {model} is a "
            f"{model_type!r} mixture of experts, which trains without it"
        )
    if tp_size > 1 or pp_size > 1:
        return (
            f"-tp {tp_size} -pp {pp_size}: ColossalAI 0.5.0's shardformer has no policy for {model_type} "
            "(its MoE policies are Mixtral's and DeepSeek's); train a Qwen3-MoE with data parallelism (-t N) and "
            "optionally ZeRO (--zero-stage 1/2), -tp 1 -pp 1"
        )
    if routing_replay and backend == "vllm":
        return VLLM_REPLAY_REFUSAL
    if lora_rank > 0 and backend == "vllm":
        return VLLM_MOE_LORA_REFUSAL
    if routing_replay and continuous_batching:
        return "--routing-replay with --continuous-batching: the continuous batcher does not record expert choices"
    if routing_replay and environment is not None:
        return f"--routing-replay with --env {environment}: multi-turn episodes do not record expert choices yet"
    return None
