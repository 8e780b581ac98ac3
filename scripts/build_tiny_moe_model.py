"""Build the embedded tiny Qwen3-MoE policy: the mixture-of-experts twin of the embedded dense model.

Writes, deterministically (fixed seeds, one thread, deterministic algorithms):

* ``colossal_rl/assets/tiny_qwen3_moe/``: a real Hugging Face ``Qwen3MoeForCausalLM`` (fp32 safetensors) with the
  embedded model's character-level tokenizer, chat template and generation config.

It reads, and never rewrites, the embedded addition task (``colossal_rl/assets/data/{train,eval}.jsonl``): the
rows are rebuilt with ``build_tiny_model.build_rows`` and checked against those files, so both models are
pre-trained on the same questions and judged on the same eval split.

Recipe: ``build_tiny_model``'s (tokenizer, prompts encoded as the RL producers encode them, shared-prefix loss,
clean then noisy ``\\boxed{<sum>}`` labels, AdamW with warmup + cosine), only the model differs: every decoder
layer is a sparse MoE block (8 experts of width ``MOE_INTERMEDIATE_SIZE``, top-2, renormalised top-k weights).

Load balancing: the pre-training loss adds ``AUX_LOSS_COEF`` (0.01) x the Switch-Transformer balance loss,
computed per layer over every non-padding token (the shared system-prompt tokens counted once per row, as in a
full batch) and averaged over layers, scaled so that perfect balance is 1.0. Chosen from the expert usage: with
``AUX_LOSS_COEF = 0`` this seed ends at a balance loss of 1.30 and expert 0 of layer 3 takes 0.1 % of the routing
slots on the eval sequences (dead; with the term no expert falls below 9 %, or 4 % on the question tokens), at
no gain in the regime (greedy 0.160, sampled 0.344, pass@8 0.915). The HF model's own ``output_router_logits``
path is not used: its mask handling assumes the router logits and the attention mask cover the same tokens, which
the shared-prefix cache breaks. The saved config keeps ``output_router_logits=False`` and
``router_aux_loss_coef=0.001`` (HF's default), so the RL trainer's forward returns no auxiliary loss unless asked
for one.

Measured (one CPU thread, this seed; 200 eval rows, 8 samples a row at temperature 1): greedy accuracy 0.060,
greedy off by one 0.915, sampled accuracy 0.294, pass@8 0.900; every expert of every layer takes 9-14 % of the
routing slots over all eval tokens (4-21 % over the question and answer tokens alone), balance loss 1.00.
0.805 M parameters (model.safetensors 3.2 MB, the dense model's size; 8 x 48-wide experts, top-2, so ~0.36 M of
them active per token). Pre-training takes about 2.5 minutes of one core (1,000 steps at ~0.16 s), the whole
build under 3 minutes. ``python rl_example.py -m colossal_rl/assets/tiny_qwen3_moe --max-steps 40 -ei 20`` (GRPO,
transformers producer) lifts greedy eval accuracy 0.060 -> 0.975 at step 20 -> 0.985 at step 40 (the dense
model: 0.215 -> 0.825 -> 0.905).

Usage: ``python scripts/build_tiny_moe_model.py [--output-root DIR] [--clean-steps N] [--noisy-steps N]
[--label-correct-probability P]``.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import (  # noqa: E402
    TaskSpec,
    TrainSpec,
    build_rows,
    build_tokenizer,
    common_prefix_length,
    evaluate,
    loss_after_shared_prefix,
    make_suffix_batch,
    optimize,
    prompt_ids_of,
    response_ids_of,
    start_build,
)

logger = logging.getLogger("build_tiny_moe_model")

SEED = 20250404
MODEL_DIR_NAME = "tiny_qwen3_moe"
NUM_EXPERTS = 8
EXPERTS_PER_TOKEN = 2
MOE_INTERMEDIATE_SIZE = 48
AUX_LOSS_COEF = 0.01
"""Weight of the per-layer balance loss (1.0 at perfect balance) in the pre-training loss."""
DEAD_EXPERT_SHARE = 0.01
"""An expert taking less than this share of a layer's routing slots on the eval prompts counts as dead."""
TRAIN = TrainSpec()


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,  # unused: every layer is sparse (mlp_only_layers empty, decoder_sparse_step 1)
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        use_sliding_window=False,
        sliding_window=None,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
        moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=12
    )
    return model


class RouterTap:
    """Forward hooks on every layer's router (``mlp.gate``) that keep its logits, in call order."""

    def __init__(self, model: Qwen3MoeForCausalLM) -> None:
        self.logits: list[torch.Tensor] = []
        self.handles = [layer.mlp.gate.register_forward_hook(self._keep) for layer in model.model.layers]

    def _keep(self, module, inputs, output) -> None:
        self.logits.append(output)

    def take(self) -> list[torch.Tensor]:
        logits, self.logits = self.logits, []
        return logits


def balance_loss(router_logits: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer balance loss of one layer: ``E * sum_e f_e * p_e`` over tokens weighted by ``weights``
    [N] (0 for padding), with ``f_e`` the share of the top-k routing slots and ``p_e`` the mean router probability
    of expert ``e``; 1.0 at perfect balance."""
    num_experts = router_logits.shape[-1]
    probs = router_logits.float().softmax(dim=-1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(dim=1).float()
    total = weights.sum()
    slot_share = (weights[:, None] * chosen).sum(dim=0) / (total * top_k)
    mean_prob = (weights[:, None] * probs).sum(dim=0) / total
    return num_experts * (slot_share * mean_prob).sum()


def pretrain(
    model: Qwen3MoeForCausalLM, tokenizer, rows: list[dict], task: TaskSpec, train: TrainSpec, aux_loss_coef: float
) -> None:
    """``build_tiny_model.pretrain``, plus ``aux_loss_coef`` x the mean per-layer balance loss."""
    generator = torch.Generator().manual_seed(SEED + 1)
    prompts = prompt_ids_of(tokenizer, rows)
    prefix_length = common_prefix_length(prompts)
    prefix = prompts[0][:prefix_length]
    answers = torch.tensor([int(row["gt_answer"]) for row in rows])
    num_layers = model.config.num_hidden_layers
    tap = RouterTap(model)
    balance_history: list[float] = []

    def loss_at(step: int) -> torch.Tensor:
        indices = torch.randint(len(rows), (train.batch_size,), generator=generator).tolist()
        correct = torch.rand(train.batch_size, generator=generator) < task.label_correct_probability
        if step < train.clean_steps:
            correct[:] = True
        labels = answers[indices] + (~correct).long()  # wrong labels are systematically one too high
        suffixes = [
            prompts[i][prefix_length:] + response_ids_of(tokenizer, int(label))
            for i, label in zip(indices, labels, strict=True)
        ]
        num_unlabelled = [len(prompts[i]) - prefix_length for i in indices]
        input_ids, suffix_mask, label_ids = make_suffix_batch(suffixes, num_unlabelled, tokenizer.pad_token_id)
        lm_loss = loss_after_shared_prefix(model, prefix, input_ids, suffix_mask, label_ids)
        router_logits = tap.take()  # the prefix pass's layers, then the suffix pass's
        assert len(router_logits) == 2 * num_layers, len(router_logits)
        # The shared prefix stands for batch_size identical rows of a full batch.
        weights = torch.cat([torch.full((prefix_length,), float(train.batch_size)), suffix_mask.reshape(-1).float()])
        balance = torch.stack(
            [
                balance_loss(torch.cat([router_logits[layer], router_logits[num_layers + layer]]), weights,
                             model.config.num_experts_per_tok)
                for layer in range(num_layers)
            ]
        ).mean()  # fmt: skip
        balance_history.append(balance.item())
        if step % 100 == 0 or step == train.steps - 1:
            logger.info("step %d balance loss %.3f (mean of last 100 %.3f; 1.0 is perfect balance)", step,
                        balance_history[-1], statistics.mean(balance_history[-100:]))  # fmt: skip
        return lm_loss + aux_loss_coef * balance

    try:
        optimize(model, train, loss_at)
    finally:
        for handle in tap.handles:
            handle.remove()


@torch.no_grad()
def expert_usage(model: Qwen3MoeForCausalLM, tokenizer, rows: list[dict], batch_size: int = 50) -> dict[str, list]:
    """Per layer, each expert's share of the top-k routing slots over the tokens of ``prompt + \\boxed{truth}<eos>``
    for ``rows``: over all tokens ("all"), and over the tokens after the shared system prompt ("question")."""
    prompts = prompt_ids_of(tokenizer, rows)
    prefix_length = common_prefix_length(prompts)
    num_layers, num_experts = model.config.num_hidden_layers, model.config.num_experts
    counts = {part: torch.zeros(num_layers, num_experts) for part in ("all", "question")}
    for start in range(0, len(rows), batch_size):
        chunk = [
            prompt + response_ids_of(tokenizer, int(row["gt_answer"]))
            for prompt, row in zip(prompts[start : start + batch_size], rows[start : start + batch_size], strict=True)
        ]
        length = max(len(s) for s in chunk)
        input_ids = torch.full((len(chunk), length), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, sequence in enumerate(chunk):
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        question_mask = mask.clone()
        question_mask[:, :prefix_length] = 0
        output = model.model(input_ids=input_ids, attention_mask=mask, output_router_logits=True, use_cache=False)
        for layer, logits in enumerate(output.router_logits):
            chosen = logits.topk(model.config.num_experts_per_tok, dim=-1).indices
            one_hot = torch.nn.functional.one_hot(chosen, num_experts).sum(dim=1).float()  # [B*T, E]
            for part, part_mask in (("all", mask), ("question", question_mask)):
                counts[part][layer] += (part_mask.reshape(-1, 1).float() * one_hot).sum(dim=0)
    return {part: (c / c.sum(dim=1, keepdim=True)).tolist() for part, c in counts.items()}


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def check_embedded_rows(data_dir: Path, train_rows: list[dict], eval_rows: list[dict]) -> None:
    """Refuse to build on rows other than the embedded task's files (where they exist): the models are pre-trained
    on the same questions and judged on the same eval split as the embedded dense model."""
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        if (data_dir / f"{split}.jsonl").exists() and read_jsonl(data_dir / f"{split}.jsonl") != rows:
            raise RuntimeError(f"{data_dir / split}.jsonl differs from build_tiny_model.build_rows: rebuild it first")


def main() -> None:
    args = start_build(__doc__, TRAIN, TaskSpec, SEED)
    start = time.perf_counter()
    task = TaskSpec(label_correct_probability=args.label_correct_probability)
    train = replace(TRAIN, clean_steps=args.clean_steps, noisy_steps=args.noisy_steps)

    train_rows, eval_rows = build_rows(task)
    check_embedded_rows(args.output_root / "data", train_rows, eval_rows)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    num_parameters = sum(p.numel() for p in model.parameters())
    logger.info(
        "model: %.3f M parameters (%d experts of width %d per layer, top-%d), aux loss coefficient %g",
        num_parameters / 1e6, NUM_EXPERTS, MOE_INTERMEDIATE_SIZE, EXPERTS_PER_TOKEN, AUX_LOSS_COEF,
    )  # fmt: skip
    pretrain(model, tokenizer, train_rows + eval_rows, task, train, AUX_LOSS_COEF)
    train_seconds = time.perf_counter() - start

    model_dir = args.output_root / MODEL_DIR_NAME
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    metrics = evaluate(model, tokenizer, eval_rows)
    for name, value in metrics.items():
        logger.info("eval %s: %.3f", name, value)
    usage = expert_usage(model, tokenizer, eval_rows)
    dead = []
    for part, table in usage.items():
        for layer, shares in enumerate(table):
            logger.info("expert usage (%s tokens) layer %d: %s", part, layer, " ".join(f"{s:.3f}" for s in shares))
            dead += [(part, layer, e) for e, s in enumerate(shares) if s < DEAD_EXPERT_SHARE]
    if dead:
        logger.warning("experts below %.0f %% of the slots (part, layer, expert): %s", 100 * DEAD_EXPERT_SHARE, dead)
    size = (model_dir / "model.safetensors").stat().st_size
    elapsed = time.perf_counter() - start
    print(
        f"built {model_dir} in {elapsed:.0f} s (pre-training {train_seconds:.0f} s), {num_parameters / 1e6:.3f} M "
        f"parameters, model.safetensors {size / 1e6:.2f} MB, {len(dead)} dead experts: "
        + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
    )


if __name__ == "__main__":
    main()
