"""What the ``rl_example.py -b vllm`` end-to-end modules share: the background run, the on-policy command and
checks, and how far a trained policy moved."""

from __future__ import annotations

import sys
from pathlib import Path

from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN_MIN_GAIN = 0.25
DEFAULT_RUN_STEPS = 20
"""The default run's first eval interval: the default run (transformers) is at 0.215 -> 0.825 eval accuracy by
step 20 of its 125; the steps after it add the same vLLM round trips again, not another check."""
ON_POLICY_MAX_LOGPROB_DIFF = 1e-3
"""Mean |log p_trainer - log p_vLLM| over a step's tokens with both at the same weights (fp32); a missed sync
shows up as ~1e-2 or more after one optimizer step."""

MIN_MOVEMENT_PER_STEP = 10 * ON_POLICY_MAX_LOGPROB_DIFF
"""Mean |log p| change per optimizer step of the trained policy (export against the initial model): a sync that
missed the engine would leave a log-prob diff of about this size, ten times what ``ON_POLICY_MAX_LOGPROB_DIFF``
lets through."""
LORA = ("--lora-rank", "4", "--lora-alpha", "8", "-lr", "2e-3")
"""LoRA at a learning rate LoRA is trained at (10x the full-weight default): the adapters move the policy by more
than ``MIN_MOVEMENT_PER_STEP`` a step."""
DIGIT_SHARE_REWARD = """
def digit_share(response, row):
    return sum(character.isdigit() for character in response) / max(1, len(response))
"""
"""A reward a random model's samples differ in (the math reward gives them all 0: no advantage, no update)."""

sys.path.insert(0, str(REPO / "tests" / "e2e"))
from test_lifecycle_e2e import Run  # noqa: E402,F401  (the background run with its marked processes)


def run_dir_in(save_dir: Path) -> Path:
    (run_dir,) = [p for p in save_dir.iterdir() if p.is_dir()]
    return run_dir


def on_policy_command(save_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "rl_example.py"), "-b", "vllm", "--no-wandb", "-nb", "0", "--max-steps", str(steps),
        "-ei", "0", "--timeout", "300", "-sd", str(save_dir), *extra,
    ]  # fmt: skip


def assert_on_policy_at_every_step(run_dir: Path, steps: int) -> list[dict]:
    """Every step trained on rollouts of the current weights, with vLLM's log-probs equal to the trainer's."""
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    diffs = [r["off_policy/logprob_abs_diff"] for r in train]
    assert max(diffs) < ON_POLICY_MAX_LOGPROB_DIFF, diffs
    assert all(r["train/staleness"] == 0 for r in train)
    return records


def logprob_movement(initial: Path, trained: Path) -> float:
    """Mean |log p_trained - log p_initial| over the answer tokens of a few prompts (the trainer's fp32 forward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(initial)
    rows = []
    for question, answer in (("12+34=", "46"), ("7+8=", "15"), ("55+21=", "76")):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        rows.append((prompt, tokenizer(f"The answer is \\boxed{{{answer}}}", add_special_tokens=False).input_ids))

    def answer_logprobs(directory: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
        found = []
        with torch.no_grad():
            for prompt, answer in rows:
                logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
                found.append(logits.log_softmax(-1).gather(-1, torch.tensor(answer)[:, None]).squeeze(-1))
        return torch.cat(found)

    return float((answer_logprobs(trained) - answer_logprobs(initial)).abs().mean())
