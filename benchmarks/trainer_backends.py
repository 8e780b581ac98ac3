"""The default run under each trainer backend: ``--trainer-backend colossalai`` against ``fsdp2`` (issue 55, item 4's
second half: "a whole default run with --trainer-backend fsdp2 learns like colossalai, 3 seeds, eval within noise";
and item 6's default-run row).

Each run is ``python rl_example.py`` in a child process with the defaults (the embedded model and task, GRPO, 1
producer + 1 trainer) except ``--max-steps`` / ``-ei`` (a shorter run that still learns clearly), ``--seed`` and
``--enable-profiling``; the two backends alternate run by run (colossalai, fsdp2, colossalai, ...), so both see the
same machine load on average. colossalai trains in the trainers' environment (torch 2.5.1, transformers 4.51.3);
fsdp2 runs every actor — producers, reward, evaluation too — in the producers' environment (torch 2.13 CPU,
transformers 5.19), so the producers' kernels change with the backend as well.

Read from each run's directory (``metrics.jsonl``, ``profile.jsonl``): greedy eval accuracy on the embedded eval set
before, at every ``-ei`` and after; the mean train reward over the last quarter of steps; samples/s over the pipeline
wall (the first rollout's generation to the last step's end and sync: ``vs_trl.pipeline_wall``, as ``scaling.py``
and ``vs_trl.py`` count it); the start-up (``time/first_rollout_s``: process start to the first rollout) and the
child's whole wall; the trainer's forward/backward, optimizer and sync seconds and the producer's generate seconds
(``scaling.analyse_run``). The last line: fsdp2 / colossalai samples/s per seed and the eval-after difference.

    python benchmarks/trainer_backends.py [--seeds 0,1,2] [--max-steps 40] [--eval-interval 20]
                                          [--backends colossalai,fsdp2] [--flags '...'] [--out results.json]
                                          [--tables results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import scaling
import vs_trl

STARTED = time.perf_counter()
REPO = vs_trl.REPO
BACKENDS = ("colossalai", "fsdp2")


def run_dir_of(save_root: Path) -> Path:
    (metrics,) = save_root.glob("*/metrics.jsonl")
    return metrics.parent


def read_run(run_dir: Path) -> dict:
    """Accuracy, reward, samples and phase seconds of one finished run."""
    from colossal_rl.config_files import CONFIG_FILE, load_config_file
    from colossal_rl.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval/math_accuracy"]) for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    startup = [r for r in records if r["kind"] == "startup"]
    config = load_config_file(run_dir / CONFIG_FILE)
    analysed = scaling.analyse_run(run_dir)
    trainer_shares = next((s for a, s in analysed["phase_shares"].items() if a.startswith("trainer")), {})

    def phase(actor_prefix: str, name: str) -> float:
        return scaling.actor_phase_seconds(analysed, actor_prefix, name)

    return {
        "steps": len(train),
        "evals": evals,
        "eval_before": evals[0][1],
        "eval_after": evals[-1][1],
        "final_reward": statistics.mean(r["train/reward"] for r in train[-max(1, len(train) // 4) :]),
        "samples": sum(r["rollout/groups"] for r in rollouts) * config.generation.num_generations,
        "pipeline_wall_s": analysed["pipeline_wall_s"],
        "first_rollout_s": startup[0].get("time/first_rollout_s") if startup else None,
        "generate_s": phase("producer", "generate"),
        "forward_backward_s": phase("trainer", "forward_backward"),
        "old_logprobs_s": phase("trainer", "old_logprobs"),
        "optimizer_s": phase("trainer", "optimizer_step"),
        "sync_s": phase("trainer", "sync"),
        "trainer_idle_share": trainer_shares.get("idle"),
    }


def run_one(backend: str, seed: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="trainer_backends-") as save_root:
        command = [sys.executable, "rl_example.py", "--trainer-backend", backend, "--seed", str(seed)]
        command += ["--max-steps", str(args.max_steps), "-ei", str(args.eval_interval), "--enable-profiling"]
        command += ["--no-wandb", "--no-final-export", "-sd", save_root, "-p", "trainer_backends"]
        command += shlex.split(args.flags)
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if finished.returncode != 0:
            raise SystemExit(f"{backend} seed {seed} failed:\n{finished.stderr[-4000:]}")
        result = read_run(run_dir_of(Path(save_root)))
    result.update(
        backend=backend,
        seed=seed,
        child_s=time.perf_counter() - started,
        load_average=[load_before, os.getloadavg()[0]],
        command=" ".join(shlex.quote(part) for part in command[1:]).replace(save_root, "DIR"),
    )
    return result


def samples_per_s(run: dict) -> float:
    return run["samples"] / run["pipeline_wall_s"]


def print_tables(runs: list[dict], command: str) -> None:
    print(f"\nCommand: {command}\n")
    head = ["seed", "backend", "steps", "eval before -> every -ei -> after", "reward (last 1/4)", "samples/s",
            "pipeline wall s", "first rollout s", "child s", "P generate s", "T pi_old s", "T fwd/bwd s",
            "T optimizer s", "T sync s", "T idle %", "load (before-after)"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in runs:
        cells = [
            str(r["seed"]), r["backend"], str(r["steps"]), " -> ".join(f"{acc:.3f}" for _, acc in r["evals"]),
            f"{r['final_reward']:.3f}", f"{samples_per_s(r):.1f}", f"{r['pipeline_wall_s']:.1f}",
            f"{r['first_rollout_s']:.1f}" if r["first_rollout_s"] is not None else "-", f"{r['child_s']:.0f}",
            f"{r['generate_s']:.1f}", f"{r['old_logprobs_s']:.1f}", f"{r['forward_backward_s']:.1f}",
            f"{r['optimizer_s']:.2f}", f"{r['sync_s']:.2f}",
            f"{100 * r['trainer_idle_share']:.0f}" if r["trainer_idle_share"] is not None else "-",
            f"{r['load_average'][0]:.1f}-{r['load_average'][1]:.1f}",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print_ratios(runs)


def print_ratios(runs: list[dict]) -> None:
    by_seed: dict[int, dict[str, dict]] = {}
    for r in runs:
        by_seed.setdefault(r["seed"], {})[r["backend"]] = r
    pairs = {seed: b for seed, b in by_seed.items() if all(name in b for name in BACKENDS)}
    if not pairs:
        return
    speed = {seed: samples_per_s(b["fsdp2"]) / samples_per_s(b["colossalai"]) for seed, b in pairs.items()}
    fb = {seed: b["fsdp2"]["forward_backward_s"] / b["colossalai"]["forward_backward_s"] for seed, b in pairs.items()}
    gen = {seed: b["fsdp2"]["generate_s"] / b["colossalai"]["generate_s"] for seed, b in pairs.items()}
    after = {name: [pairs[seed][name]["eval_after"] for seed in pairs] for name in BACKENDS}
    print(
        "\nfsdp2 / colossalai: samples/s x"
        + f"{statistics.mean(speed.values()):.2f} ("
        + ", ".join(f"seed {s} x{v:.2f}" for s, v in speed.items())
        + f"); trainer fwd/bwd s x{statistics.mean(fb.values()):.2f}; producer generate s x"
        + f"{statistics.mean(gen.values()):.2f}; eval after colossalai "
        + ", ".join(f"{a:.3f}" for a in after["colossalai"])
        + f" (mean {statistics.mean(after['colossalai']):.3f}), fsdp2 "
        + ", ".join(f"{a:.3f}" for a in after["fsdp2"])
        + f" (mean {statistics.mean(after['fsdp2']):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated --seed values")
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps a run (the default run: 125)")
    parser.add_argument("--eval-interval", type=int, default=20, help="-ei: greedy eval every this many steps")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, alternated in this order")
    parser.add_argument("--flags", default="", help="more rl_example.py flags for every run")
    parser.add_argument("--out", type=Path, help="write every run's results here as JSON")
    parser.add_argument("--tables", type=Path, help="print the tables of a --out JSON file again and stop")
    args = parser.parse_args()
    if args.tables:
        saved = json.loads(args.tables.read_text())
        print_tables(saved["runs"], saved["command"])
        return
    command = "python benchmarks/trainer_backends.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    seeds = [int(seed) for seed in args.seeds.split(",")]
    backends = args.backends.split(",")
    print(
        f"default run, {args.max_steps} steps, eval every {args.eval_interval}; seeds {seeds}; backends {backends} "
        f"alternating; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs = []
    for seed in seeds:
        for backend in backends:
            run = run_one(backend, seed, args)
            runs.append(run)
            print(
                f"[{time.perf_counter() - STARTED:5.0f} s] seed {seed} {backend}: eval {run['eval_before']:.3f} -> "
                f"{run['eval_after']:.3f}, {samples_per_s(run):.1f} samples/s over {run['pipeline_wall_s']:.1f} s, "
                f"child {run['child_s']:.0f} s",
                flush=True,
            )
    out = args.out or Path(tempfile.gettempdir()) / "colossal-rl-bench" / "trainer_backends.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "runs": runs}, indent=1))
    print_tables(runs, command)
    print(f"\nraw results: {out}; {time.perf_counter() - STARTED:.0f} s in all")


if __name__ == "__main__":
    main()
