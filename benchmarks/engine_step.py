"""One trainer step (forward, backward, clip + optimizer step) of the same model under four setups, to separate what
``--trainer-backend fsdp2`` changes (issue 55, item 6): the kernels (torch 2.5.1 + transformers 4.51.3, the trainers'
environment, against torch 2.13 + transformers 5.19, the producers') and each engine's own cost on 1 rank.

- ``plain-2.5``: the Hugging Face model and ``torch.optim.AdamW`` in the trainers' environment, no engine.
- ``colossalai-2.5``: the same through ``ColossalAIEngine`` (the plugin ``rl_example.py``'s defaults choose), 1 rank.
- ``plain-2.13``: the plain model in the producers' environment (``ensure_producer_env``'s interpreter).
- ``fsdp2-2.13``: the same through ``FSDP2Engine`` (``fully_shard`` per decoder layer, then the root), 1 rank.

kernels = plain-2.13 / plain-2.5; an engine's own cost = engine / plain in its environment; the last column is what a
trainer sees, fsdp2-2.13 / colossalai-2.5. Models: the embedded 0.8 M Qwen2 (``tiny``) and ``scaling.py``'s random 1 /
10 / 40 M Qwen2s (built by it if missing). The batch: ``--samples`` random sequences of ``--tokens`` positions (the
default run's ~85 prompt + 16 response tokens), all positions real; the loss is ``-mean(advantage x log-prob)`` over
the last 16 positions (the GRPO objective's cost, without its bookkeeping), the same code in every setup. One thread
(what each trainer actor gets on 2 cores), fp32. Each setup is one child process that runs every model (``--warmup``
untimed steps, then ``--steps`` timed); setups take turns for ``--rounds`` rounds, the order reversed every other
round; reported: the median step over all rounds.

Not measured here: the trainer's own log-prob code (under colossalai it computes log-probs from hidden states chunk
by chunk, ``train.logits_from_hidden``; fsdp2 cannot, its output head being whole only inside the forward), weight
sync and checkpoints; ``trainer_backends.py`` and ``scaling.py --compare-flags '--trainer-backend fsdp2'`` see those.

    python benchmarks/engine_step.py [--sizes tiny,1m,10m,40m] [--samples 8] [--tokens 101] [--steps 3]
                                     [--rounds 4] [--threads 1] [--out results.json] [--tables results.json]
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
from pathlib import Path

STARTED = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
CASES = ("plain-2.5", "colossalai-2.5", "plain-2.13", "fsdp2-2.13")
RESPONSE_TOKENS = 16
PHASES = ("forward", "backward", "optimizer")


# ---------------------------------------------------------------------------------------------- child
def load_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    from colossal_rl.hf_compat import dtype_kwargs

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs(torch.float32), attn_implementation="sdpa")


def objective(model, input_ids, advantages):
    """``-mean(advantage x log-prob)`` over the last ``RESPONSE_TOKENS`` positions."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits  # [B, T, V]
    logprobs = torch.log_softmax(logits[:, -RESPONSE_TOKENS - 1 : -1].float(), dim=-1)
    taken = logprobs.gather(-1, input_ids[:, -RESPONSE_TOKENS:, None]).squeeze(-1)  # [B, R]
    return -(advantages[:, None] * taken).mean()


class Plain:
    """The model and AdamW, no engine: what the kernels alone cost."""

    def __init__(self, model, learning_rate: float):
        import torch

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)

    def backward(self, loss) -> None:
        loss.backward()

    def optimizer_step(self, max_norm: float) -> None:
        import torch

        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()


def make_engine(backend: str, path: str, model):
    """``backend``'s engine around ``model`` on a 1-rank gloo group, built from ``rl_example.py``'s defaults."""
    import torch
    import torch.distributed as dist

    from colossal_rl.command_line import build_parser, config_from_args
    from colossal_rl.training.engines import make_engine as engine_for
    from colossal_rl.training.engines.base import PolicyTraits

    config = config_from_args(build_parser().parse_args(["-m", path, "--trainer-backend", backend]))
    engine = engine_for(config)
    if not dist.is_initialized():
        engine.start_process_group(0, 1, dist.HashStore(), on_cpu=True, timeout_s=600)
    learning_rate = config.train.learning_rate
    engine.wrap(
        model,
        PolicyTraits(),
        lambda parameters: torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0),
        lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    return engine


def time_steps(trainer, vocab_size: int, args: argparse.Namespace) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, vocab_size, (args.samples, args.tokens), generator=generator)  # [B, T]
    advantages = torch.randn(args.samples, generator=generator)  # [B]
    steps = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = objective(trainer.model, input_ids, advantages)
        t1 = time.perf_counter()
        trainer.backward(loss)
        t2 = time.perf_counter()
        trainer.optimizer_step(1.0)
        t3 = time.perf_counter()
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
    return steps[args.warmup :]


def run_child(case: str, paths: dict[str, str], args: argparse.Namespace) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    kind, _ = case.split("-")
    results = {"torch": torch.__version__, "transformers": transformers.__version__, "sizes": {}}
    for size, path in paths.items():
        model = load_model(path)
        trainer = Plain(model, 2e-4) if kind == "plain" else make_engine(kind, path, model)
        results["sizes"][size] = time_steps(trainer, model.config.vocab_size, args)
        del trainer, model
    return results


# ---------------------------------------------------------------------------------------------- parent
def interpreter(case: str) -> str:
    if case.endswith("-2.5"):
        return sys.executable
    from colossal_rl.producer_env import ensure_producer_env

    return str(ensure_producer_env())


def launch(case: str, paths: dict[str, str], args: argparse.Namespace) -> dict:
    command = [interpreter(case), __file__, "--child", case, "--child-paths", json.dumps(paths)]
    command += ["--samples", str(args.samples), "--tokens", str(args.tokens), "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if finished.returncode != 0:
        raise SystemExit(f"{case} failed:\n{finished.stderr[-4000:]}")
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    result["child_s"] = time.perf_counter() - started
    return result


STAT = {"median": statistics.median, "min": min}


def step_seconds(steps: list[dict], phase: str | None = None, stat: str = "median") -> float:
    """The median (or ``stat``) of the steps' seconds, whole or one phase."""
    return STAT[stat]([sum(s[p] for p in PHASES) if phase is None else s[phase] for s in steps])


def print_tables(saved: dict, stat: str = "median") -> None:
    runs, params = saved["runs"], saved["params"]
    versions = {case: f"torch {runs[case][0]['torch']}, transformers {runs[case][0]['transformers']}" for case in runs}
    print(f"\nCommand: {saved['command']}; the {stat} step over every round")
    print("Environments: " + "; ".join(f"{case}: {v}" for case, v in versions.items()) + "\n")
    steps = {case: {size: [s for child in children for s in child["sizes"][size]] for size in params}
             for case, children in runs.items()}  # fmt: skip
    head = ["model", "params", *(f"{case} s" for case in CASES), "kernels: plain 2.13 / 2.5",
            "colossalai's own: / plain 2.5", "FSDP2's own: / plain 2.13", "fsdp2 / colossalai"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for size, count in params.items():
        t = {case: step_seconds(steps[case][size], stat=stat) for case in CASES}
        print(
            f"| {size} | {count / 1e6:.2f} M | " + " | ".join(f"{t[case]:.3f}" for case in CASES)
            + f" | x{t['plain-2.13'] / t['plain-2.5']:.2f} | x{t['colossalai-2.5'] / t['plain-2.5']:.2f}"
            + f" | x{t['fsdp2-2.13'] / t['plain-2.13']:.2f} | x{t['fsdp2-2.13'] / t['colossalai-2.5']:.2f} |"
        )  # fmt: skip
    print(f"\nPer phase, {stat} seconds (forward / backward / clip + optimizer step):\n")
    print("| model | " + " | ".join(CASES) + " |")
    print("|" + "|".join("---" for _ in range(len(CASES) + 1)) + "|")
    for size in params:
        cells = [
            " / ".join(f"{step_seconds(steps[case][size], phase, stat):.3f}" for phase in PHASES) for case in CASES
        ]
        print(f"| {size} | " + " | ".join(cells) + " |")
    ratios = []
    for size in params:
        t = {case: step_seconds(steps[case][size], stat=stat) for case in CASES}
        ratios.append(
            f"{size}: kernels x{t['plain-2.13'] / t['plain-2.5']:.2f}, FSDP2 x{t['fsdp2-2.13'] / t['plain-2.13']:.2f}, "
            f"colossalai x{t['colossalai-2.5'] / t['plain-2.5']:.2f}, fsdp2/colossalai "
            f"x{t['fsdp2-2.13'] / t['colossalai-2.5']:.2f}"
        )
    print("\n" + "; ".join(ratios))


def model_paths(sizes: list[str], cache_dir: Path) -> dict[str, str]:
    from colossal_rl.config import EMBEDDED_MODEL_DIR

    paths = {}
    for size in sizes:
        if size == "tiny":
            paths[size] = str(EMBEDDED_MODEL_DIR)
        else:
            import scaling

            paths[size] = str(scaling.model_dir("qwen2", size, cache_dir))
    return paths


def parameter_counts(paths: dict[str, str]) -> dict[str, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    counts = {}
    for size, path in paths.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        counts[size] = sum(p.numel() for p in model.parameters())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,1m,10m,40m", help="comma-separated: tiny and scaling.py's sizes")
    parser.add_argument("--samples", type=int, default=8, help="sequences per step (the trainer's -tmbs: 32)")
    parser.add_argument("--tokens", type=int, default=101, help="positions per sequence")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model and child")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model and child")
    parser.add_argument("--rounds", type=int, default=4, help="turns of the four setups")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a trainer actor's on 2 cores: 1)")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "colossal-rl-bench" / "scaling")
    parser.add_argument("--out", type=Path, help="write the raw step times here as JSON")
    parser.add_argument("--tables", type=Path, help="print the tables of a --out JSON file again and stop")
    parser.add_argument("--stat", choices=sorted(STAT), default="median", help="of the timed steps, in the tables")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--child-paths", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, json.loads(args.child_paths), args)))
        return
    if args.tables:
        print_tables(json.loads(args.tables.read_text()), args.stat)
        return
    command = "python benchmarks/engine_step.py " + " ".join(sys.argv[1:])
    paths = model_paths(args.sizes.split(","), args.cache_dir.expanduser())
    print(
        f"{list(paths)}: {args.samples} x {args.tokens} tokens a step, {args.threads} thread(s), {args.rounds} rounds "
        f"of {CASES}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for round_index in range(args.rounds):
        for case in CASES if round_index % 2 == 0 else reversed(CASES):
            result = launch(case, paths, args)
            runs[case].append(result)
            summary = ", ".join(f"{size} {step_seconds(steps):.3f} s" for size, steps in result["sizes"].items())
            print(f"[{time.perf_counter() - STARTED:5.0f} s] round {round_index} {case}: {summary}", flush=True)
    saved = {"command": command, "params": parameter_counts(paths), "runs": runs, "load_average": os.getloadavg()}
    out = args.out or args.cache_dir.expanduser() / "engine_step.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1))
    print_tables(saved, args.stat)
    print(f"\nraw results: {out}; {time.perf_counter() - STARTED:.0f} s in all")


if __name__ == "__main__":
    main()
