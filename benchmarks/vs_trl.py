"""colossal-rl against TRL's ``GRPOTrainer`` on CPU: wall time and accuracy for the same number of samples.

Both sides get the same model, dataset, group size, prompts per optimizer step, max new tokens,
learning rate (constant), optimizer (AdamW, grad-norm clip 1.0), sampling (temperature 1, no top-k/p),
loss (GRPO: clipped ratio, per-sample token mean, std-normalised group advantages, no KL) and number
of optimizer steps, hence of samples. colossal-rl runs through ``run_training``; TRL 0.17 runs
``GRPOTrainer`` with ``use_cpu=True`` in one process using every core.
TRL tokenises string prompts without special tokens, so it is given the exact text our chat template
produces (checked: it encodes back to the same token ids). Both are evaluated greedily on the embedded
eval set by the same code (``Producer.evaluate``).

Models: ``tiny`` is the embedded 0.8 M-parameter Qwen2; ``medium`` is a ~10x larger Qwen2 (hidden 256,
10 layers, 7.9 M parameters) built with ``scripts/build_tiny_model.py``'s functions and a shorter
supervised pre-training, cached in ``--cache-dir`` (deterministic; rebuilt only if missing).

Each run happens in its own child process (so thread settings and imports do not leak), one after
the other: ours with 1 producer + 1 consumer (``ours``, n_behind 1), ours in the best configuration
found (``ours*``, see ``BEST``; on ``--best-models`` only), then TRL. Ray runs its actors at niceness 15,
so the TRL child lowers itself to the same niceness: on a machine shared with other jobs both
systems get the same share. TRL's "eval before" is ours (same initial weights, same greedy code).
Reported per run: end-to-end wall (process start to trained and evaluated), training wall (ours: from its
first rollout's generation to its last step's end and sync, from the ``--enable-profiling`` spans — until
2026-11-28 the sum of its training orders and syncs, which leaves out the first rollout and every wait for
rollouts and flattered ours 1.1-1.3x; TRL: ``trainer.train()``), samples/s and generated tokens/s over the training wall,
greedy eval accuracy before -> after, mean train reward over the last quarter of the steps. The last
line gives ours/TRL ratios (samples/s, end-to-end wall: TRL's over ours) and both final accuracies.

Rollout shapes (``--shape``): ``default`` is the embedded task as ``python rl_example.py`` runs it (the
reward's ~70-token system prompt, 16 new tokens: prompts ~5x longer than responses); ``long_responses``
gives both systems the one-word system prompt ``Add.`` and 64 new tokens (prompts of ~14 tokens; the model,
pre-trained with the long prompt, answers at length), the shape where sharing the prompt saves least.
Reported too, per run: the training forward's computed / real token ratio (positions computed per real
prompt + response token, each sample counted on its own): ours from the trainer's metrics, TRL's counted
by a forward hook on its policy during ``train()`` (the forwards that build the graph).

    python benchmarks/vs_trl.py [--models tiny,medium] [--shape default] [--steps N] [--seeds 0,1,2] [--quick]
                                [--n-behind 1] [--best '0 -t 2 -tbs 8 -tMbs 8']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STARTED = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
MEDIUM_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=10, num_attention_heads=4)
MEDIUM_PRETRAIN = dict(clean_steps=300, noisy_steps=150)  # the tiny model uses 600 + 400
BUILD_VERSION = 1  # bump when the medium model's recipe changes
# Ray starts its workers at niceness 15 (RayConfig worker_niceness); the TRL child runs at the same
# niceness so that, on a machine shared with other jobs, both systems get the same share of the cores.
RAY_WORKER_NICENESS = 15
# Optimizer steps per run and model: keeps the whole script (5 runs) under 10 minutes on 2 shared cores.
STEPS = {"tiny": 8, "medium": 4}
# n_behind and rl_example.py flags of the fastest configuration found: two data-parallel trainers (8
# prompts each, so still 16 prompts per optimizer step) beside the producer (see benchmarks/README.md)
BEST = "0 -t 2 -tbs 8 -tMbs 8"


@dataclass(frozen=True)
class Settings:
    """What both systems are given, identically."""

    steps: int
    num_generations: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int = 16
    learning_rate: float = 2e-4
    seed: int = 0
    system_prompt: str | None = None
    """None: the reward type's default system prompt."""

    @property
    def samples(self) -> int:
        return self.steps * self.prompts_per_step * self.num_generations


SHAPES = {
    "default": {},
    "long_responses": {"system_prompt": "Add.", "max_new_tokens": 64},
}
"""Settings changes per rollout shape (see the module docstring)."""


# ---------------------------------------------------------------------------------------------- models
def _build_script():
    sys.path.insert(0, str(REPO / "scripts"))
    import build_tiny_model

    return build_tiny_model


def medium_model_dir(cache_dir: Path) -> Path:
    """The ~10x model, built deterministically on first use (a few minutes) and reused after."""
    model_dir = cache_dir / f"qwen2_medium_v{BUILD_VERSION}"
    if (model_dir / "model.safetensors").is_file():
        return model_dir
    import torch
    from transformers import Qwen2ForCausalLM

    build = _build_script()
    torch.set_num_threads(min(2, os.cpu_count() or 1))  # fixed thread count: reproducible reductions
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(build.SEED)
    tokenizer = build.build_tokenizer()
    tiny = build.build_model(tokenizer)
    config = tiny.config
    for name, value in MEDIUM_SHAPE.items():
        setattr(config, name, value)
    model = Qwen2ForCausalLM(config)
    model.generation_config = tiny.generation_config
    task = build.TaskSpec()
    train_rows, eval_rows = build.build_rows(task)
    started = time.perf_counter()
    print(f"building the medium model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) ...")
    build.pretrain(model, tokenizer, train_rows + eval_rows, task, build.TrainSpec(**MEDIUM_PRETRAIN))
    partial = cache_dir / f"{model_dir.name}.partial-{os.getpid()}"
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(model_dir)
    metrics = build.evaluate(model, tokenizer, eval_rows)
    print(f"built {model_dir} in {time.perf_counter() - started:.0f} s: {metrics}")
    return model_dir


def model_path(name: str, cache_dir: Path) -> str:
    from colossal_rl.config import EMBEDDED_MODEL_DIR

    return str(EMBEDDED_MODEL_DIR) if name == "tiny" else str(medium_model_dir(cache_dir))


# ---------------------------------------------------------------------------------------------- evaluation
def rl_config(model: str, settings: Settings, n_behind: int, save_dir: str, extra_flags: list[str]):
    """Our run config, built by the CLI so it is exactly what a user gets with these flags."""
    from colossal_rl.command_line import build_parser, config_from_args

    flags = [
        *("-m", model, "-g", str(settings.num_generations), "-ibs", str(settings.prompts_per_step)),
        *("-imbs", str(settings.prompts_per_step), "-tbs", str(settings.prompts_per_step)),
        *("-tMbs", str(settings.prompts_per_step), "-mnt", str(settings.max_new_tokens)),
        *("-lr", str(settings.learning_rate), "-nb", str(n_behind), "--max-steps", str(settings.steps)),
        *("-ei", "0", "-sd", save_dir, "--seed", str(settings.seed), "-p", "vs_trl"),
        *(("-s", settings.system_prompt) if settings.system_prompt is not None else ()),
        *extra_flags,
    ]
    return config_from_args(build_parser().parse_args(flags))


def greedy_eval(config, state_dict=None) -> float:
    """Greedy accuracy on the eval set with our producer's evaluation code (optionally other weights)."""
    from colossal_rl.reward import build_reward_scorer
    from colossal_rl.rollout.producer import Producer

    scorer = build_reward_scorer(reward_type="boxed", code_verifier_url=None, reward_fn=None)
    try:
        producer = Producer(0, config, scorer)
        if state_dict is not None:
            producer.backend.load_weights(state_dict)
        (result,) = producer.evaluate(1)
        return result.accuracy
    finally:
        scorer.close()


# ---------------------------------------------------------------------------------------------- children
def run_ours(model: str, settings: Settings, n_behind: int, extra_flags: list[str]) -> dict:
    import logging

    from colossal_rl.driver.launch import run_training
    from colossal_rl.metrics import read_metrics

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as save_dir:
        config = rl_config(model, settings, n_behind, save_dir, ["--enable-profiling", *extra_flags])
        summary = run_training(config, use_wandb=False)
        records = read_metrics(Path(summary.run_dir) / "metrics.jsonl")
        wall = pipeline_wall(Path(summary.run_dir))
    train = [r for r in records if r["kind"] == "train"]
    last = train[-max(1, len(train) // 4) :]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    return {
        "samples": sum(r["rollout/groups"] for r in rollouts) * settings.num_generations,
        "tokens": sum(r["rollout/groups"] * r["rollout/response_length"] for r in rollouts) * settings.num_generations,
        "steps": summary.steps,
        "end_to_end_s": time.perf_counter() - STARTED,
        # the first rollout's generation to the last step's end and its sync: what TRL's train() covers
        "train_s": wall,
        # what this script reported before 2026-11-28: the training orders plus the syncs, the trainer's busy
        # time only (it leaves out the first rollout and every wait for rollouts: 1.1-1.3x flattering)
        "orders_s": sum(r["time/train_order_s"] for r in train if "time/train_order_s" in r)
        + sum(r["time/sync_s"] for r in records if r["kind"] == "sync" and "time/sync_s" in r),
        "eval_before": summary.eval_accuracy_before["math"],
        "eval_after": summary.eval_accuracy_after["math"],
        "final_reward": statistics.mean(r["train/reward"] for r in last),
        "computed_per_real": sum(r["train/computed_tokens"] for r in train)
        / sum(r["train/real_tokens"] for r in train),
    }


def pipeline_wall(run_dir: Path) -> float:
    """Seconds from the first rollout's generation to the end of the last training span (its step, its sync), from
    the run's ``--enable-profiling`` spans: the part of our run that TRL's ``trainer.train()`` covers."""
    from colossal_rl.profiling import read_spans

    spans = read_spans(run_dir)
    generating = [s.start for actor, spans_ in spans.items() if actor.startswith("producer") for s in spans_
                  if s.phase == "generate"]  # fmt: skip
    training = [s.end for actor, spans_ in spans.items() if actor.startswith("trainer") for s in spans_
                if s.phase != "checkpoint"]  # fmt: skip
    return max(training) - min(generating)


class TrainingTokenCounter:
    """Forward pre-hook on TRL's policy: positions computed vs real tokens of the forwards run with grad on."""

    def __init__(self):
        self.computed = self.real = 0

    def __call__(self, module, args, kwargs):
        import torch

        if torch.is_grad_enabled() and kwargs.get("attention_mask") is not None:
            self.computed += kwargs["attention_mask"].numel()
            self.real += int(kwargs["attention_mask"].sum())


def trl_dataset(config, settings: Settings):
    """Prompts as the text of our chat template, verified to encode back to our exact token ids."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from colossal_rl.data import load_prompt_dataset
    from colossal_rl.prompts import system_prompt_for

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    system_prompt = system_prompt_for("boxed", settings.system_prompt)
    prompts = load_prompt_dataset(config.data.train_path, tokenizer, system_prompt, config.data.max_prompt_tokens)
    texts = [tokenizer.decode(ids) for ids in prompts.prompt_ids]
    for text, ids in zip(texts, prompts.prompt_ids, strict=True):
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            raise RuntimeError(f"TRL would see different tokens for prompt {text!r}")
    rows = [{"prompt": text, "gt_answer": row["gt_answer"]} for text, row in zip(texts, prompts.rows, strict=True)]
    return tokenizer, Dataset.from_list(rows)


def run_trl(model: str, settings: Settings, eval_before: float | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from colossal_rl.reward import build_reward_scorer

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as save_dir:
        config = rl_config(model, settings, 0, save_dir, [])
    tokenizer, dataset = trl_dataset(config, settings)
    scorer = build_reward_scorer(reward_type="boxed", code_verifier_url=None, reward_fn=None)

    def boxed_reward(prompts, completions, gt_answer, **_) -> list[float]:
        rows = [{"gt_answer": answer} for answer in gt_answer]
        return [record.reward for record in scorer.score_batch(completions, rows)]

    if eval_before is None:
        eval_before = greedy_eval(config)
    with tempfile.TemporaryDirectory() as output_dir:
        trl_config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
            gradient_accumulation_steps=1,
            num_generations=settings.num_generations,
            max_completion_length=settings.max_new_tokens,
            max_prompt_length=config.data.max_prompt_tokens,
            learning_rate=settings.learning_rate,
            lr_scheduler_type="constant",
            optim="adamw_torch",
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="grpo",
            epsilon=0.2,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_steps=settings.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=settings.seed,
            disable_tqdm=True,
        )
        policy = AutoModelForCausalLM.from_pretrained(config.model.path, torch_dtype=torch.float32)
        counter = TrainingTokenCounter()
        policy.register_forward_pre_hook(counter, with_kwargs=True)
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=boxed_reward,
            args=trl_config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        started = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - started
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = [entry["reward"] for entry in logged]
    batch = trl_config.per_device_train_batch_size
    tokens = sum(entry["completions/mean_length"] * batch for entry in logged)
    eval_after = greedy_eval(config, {k: v.detach() for k, v in policy.state_dict().items()})
    scorer.close()
    return {
        "samples": trainer.state.global_step * batch,
        "tokens": tokens,
        "steps": trainer.state.global_step,
        "end_to_end_s": time.perf_counter() - STARTED,
        "train_s": train_s,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "final_reward": statistics.mean(rewards[-max(1, len(rewards) // 4) :]),
        "computed_per_real": counter.computed / max(counter.real, 1),
    }


def _run_child(system: str, model: str, settings: Settings, n_behind: int, flags: str, eval_before=None) -> dict:
    command = [sys.executable, __file__, "--child", system, "--child-model", model, "--child-settings"]
    command += [json.dumps(asdict(settings)), "--n-behind", str(n_behind), f"--ours-flags={flags}"]
    if eval_before is not None:
        command += ["--child-eval-before", str(eval_before)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if finished.returncode != 0:
        raise SystemExit(f"{system} on {model} failed:\n{finished.stderr[-4000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def _print_row(model: str, seed: int, system: str, r: dict) -> None:
    print(
        f"{model:8}{seed:>5} {system:8}{r['samples']:8.0f}{r['end_to_end_s']:8.1f}{r['train_s']:9.1f}"
        f"{r['samples'] / r['train_s']:11.1f}{r['tokens'] / r['train_s']:10.0f}{r['computed_per_real']:10.2f}"
        f"{r['eval_before']:8.3f}->{r['eval_after']:.3f}{r['final_reward']:8.3f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,medium", help="comma-separated: tiny, medium")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default", help="rollout shape (see above)")
    parser.add_argument(
        "--steps", type=int, help=f"optimizer steps (x 16 prompts x 8 samples) for every model; default {STEPS}"
    )
    parser.add_argument("--seeds", default="0", help="comma-separated seeds of both systems (data order, sampling)")
    parser.add_argument("--quick", action="store_true", help="tiny model only, no 'best' run")
    parser.add_argument("--n-behind", type=int, default=1, help="our producers' allowed staleness (plain run)")
    parser.add_argument("--ours-flags", default="", help="extra rl_example.py flags for our plain run")
    parser.add_argument(
        "--best", default=BEST, help="n_behind and flags of our best configuration found ('' to skip that run)"
    )
    parser.add_argument("--best-models", default="tiny", help="models on which the 'best' configuration runs too")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "colossal-rl-bench")
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-settings", help=argparse.SUPPRESS)
    parser.add_argument("--child-eval-before", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        settings = Settings(**json.loads(args.child_settings))
        if args.child == "ours":
            result = run_ours(args.child_model, settings, args.n_behind, args.ours_flags.split())
        else:
            os.nice(RAY_WORKER_NICENESS - os.nice(0))  # the same CPU priority as our Ray actors get
            result = run_trl(args.child_model, settings, args.child_eval_before)
        print(json.dumps(result))
        return

    models = ["tiny"] if args.quick else args.models.split(",")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    configs = {"ours": (args.n_behind, args.ours_flags)}
    if args.best and not args.quick:
        best_n_behind, _, best_flags = args.best.partition(" ")
        configs["ours*"] = (int(best_n_behind), best_flags)
    steps = {name: args.steps or STEPS[name] for name in models}
    example = Settings(steps=1, **SHAPES[args.shape])
    print(
        f"shape {args.shape}: steps {steps} x {example.prompts_per_step} prompts x {example.num_generations} samples, "
        f"{example.max_new_tokens} new tokens, system prompt {example.system_prompt or 'default'}, "
        f"lr {example.learning_rate}, seeds {seeds}, {os.cpu_count()} CPU cores; ours: 1 producer + 1 consumer, "
        + ", ".join(f"{name} n_behind {nb} {flags}".rstrip() for name, (nb, flags) in configs.items()),
        flush=True,
    )
    print(
        f"{'model':8}{'seed':>5} {'system':8}{'samples':>8}{'e2e s':>8}{'train s':>9}{'samples/s':>11}"
        f"{'tokens/s':>10}{'comp/real':>10}{'eval before->after':>20}{'reward':>8}",
        flush=True,
    )
    speedups: dict[str, list[float]] = {}
    for seed in seeds:
        for name in models:
            path = model_path(name, args.cache_dir.expanduser())
            settings = Settings(steps=steps[name], seed=seed, **SHAPES[args.shape])
            results = {}
            systems = [s for s in configs if s == "ours" or name in args.best_models.split(",")]
            for system in systems:
                n_behind, flags = configs[system]
                results[system] = _run_child("ours", path, settings, n_behind, flags)
                _print_row(name, seed, system, results[system])
            # Same initial weights and the same greedy evaluation code: TRL's "before" is ours.
            results["trl"] = _run_child("trl", path, settings, 0, "", results["ours"]["eval_before"])
            _print_row(name, seed, "trl", results["trl"])
            trl = results["trl"]
            for system in systems:
                ours = results[system]
                speed = (ours["samples"] / ours["train_s"]) / (trl["samples"] / trl["train_s"])
                speedups.setdefault(f"{name} {system}", []).append(speed)
    summary = "; ".join(
        f"{key}: samples/s x{statistics.mean(values):.2f} (" + ", ".join(f"x{v:.2f}" for v in values) + ")"
        for key, values in speedups.items()
    )
    print(f"ours/TRL over seeds {seeds} ({time.perf_counter() - STARTED:.0f} s total): {summary}")


if __name__ == "__main__":
    main()
