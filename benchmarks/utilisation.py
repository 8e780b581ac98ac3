"""Utilisation: the fraction of wall time producers spend generating and trainers spend computing.

Runs ``rl_example.py --enable_profiling`` in a child process once per ``n_behind`` (sequentially, so
the runs do not share the cores), reads each run's ``profile.jsonl`` with
``colossal_rl.profiling.read_spans`` and reports ``busy_fractions`` over the training rounds. The
evaluations before and after training are left out (their spans are dropped before the fractions
are taken), so the wall is the round loop: first recorded training phase to last. Two windows:

  loop     the whole round loop, including the pipeline's fill (the trainer waits for the first
           rollouts) and drain (producers have nothing left to generate while the last rounds train)
  steady   from the first rollout handed to the buffer to the last one: fill and drain left out

Per actor: producers ``generate`` (and ``busy``: generate + reward + postprocess + put), trainers
``compute`` (forward_backward + optimizer_step); ``sync`` is receiving / sending weights (for a
producer this includes waiting in the broadcast for the trainer to finish its round) and ``idle`` is
time in no phase (a producer with nothing queued, a trainer between calls). ``waiting`` = sync +
idle (a trainer waiting for rollouts is idle). The goal: with ``n_behind=1`` producers idle < 10 %
(in the steady window).

    python benchmarks/utilisation.py [--steps 16] [--n-behind 0,1] [--flags '-t 2 -tbs 8 -tMbs 8']
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from colossal_rl.profiling import Span, busy_fractions, read_spans  # noqa: E402

PRODUCER_WORK = ("generate", "reward", "postprocess", "put")
TRAINER_COMPUTE = ("forward_backward", "optimizer_step")
LEFT_OUT = ("eval",)


def run_profiled(n_behind: int, steps: int, extra_flags: list[str]) -> tuple[dict[str, list[Span]], float]:
    """One profiled training run in a child process; its spans without the evaluations, and its wall time."""
    with tempfile.TemporaryDirectory() as save_dir:
        command = [sys.executable, str(REPO / "rl_example.py"), "--enable_profiling", "--no-wandb"]
        command += ["-nb", str(n_behind), "--max-steps", str(steps), "-ei", "0", "-sd", save_dir]
        command += ["--log-rollout-interval", "0", "-p", f"utilisation-nb{n_behind}", *extra_flags]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        started = time.perf_counter()
        finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        wall = time.perf_counter() - started
        if finished.returncode != 0:
            raise SystemExit(f"n_behind={n_behind} failed:\n{finished.stderr[-4000:]}")
        (run_dir,) = Path(save_dir).iterdir()
        spans = read_spans(run_dir)
    kept = {actor: [s for s in actor_spans if s.phase not in LEFT_OUT] for actor, actor_spans in spans.items()}
    return kept, wall


def steady_window(spans: dict[str, list[Span]]) -> dict[str, list[Span]]:
    """The spans clipped to [end of the first producer hand-off, end of the last]: fill and drain left out."""
    puts = [s.end for actor, actor_spans in spans.items() for s in actor_spans if s.phase == "put"]
    start, end = min(puts), max(puts)
    marks = [Span("window", start, start), Span("window", end, end)]  # zero-length: pin busy_fractions' wall
    return {
        actor: marks
        + [Span(s.phase, max(s.start, start), min(s.end, end)) for s in spans if s.end > start and s.start < end]
        for actor, spans in spans.items()
    }


def summarise(fractions: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    rows = {}
    for actor, phases in fractions.items():
        if actor.startswith("producer"):
            work = sum(phases.get(p, 0.0) for p in PRODUCER_WORK)
            rows[actor] = {"main": phases.get("generate", 0.0), "busy": work}
        else:
            work = sum(phases.get(p, 0.0) for p in TRAINER_COMPUTE)
            rows[actor] = {"main": work, "busy": work + phases.get("fetch", 0.0)}
        rows[actor] |= {"sync": phases.get("sync", 0.0), "idle": phases.get("idle", 0.0) + phases.get("wait", 0.0)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run (one round each by default)")
    parser.add_argument("--n-behind", default="0,1", help="comma-separated n_behind values, one run each")
    parser.add_argument("--flags", default="", help="extra rl_example.py flags for every run, e.g. '-t 2 -tbs 8'")
    args = parser.parse_args()
    started = time.perf_counter()
    print(
        f"rl_example.py defaults (tiny model, 1 producer + 1 trainer) {args.flags}".rstrip()
        + f", {args.steps} steps per run, {os.cpu_count()} CPU cores; evaluations excluded",
        flush=True,
    )
    print(
        f"{'n_behind':>8} {'window':7}{'actor':12}{'gen/compute':>12}{'busy':>8}{'sync':>8}{'idle+wait':>11}{'wall s':>8}"
    )
    results = {}
    for n_behind in (int(n) for n in args.n_behind.split(",")):
        spans, child_wall = run_profiled(n_behind, args.steps, args.flags.split())
        for window, windowed in (("loop", spans), ("steady", steady_window(spans))):
            all_spans = [s for actor_spans in windowed.values() for s in actor_spans]
            wall = max(s.end for s in all_spans) - min(s.start for s in all_spans)
            rows = summarise(busy_fractions(windowed))
            for actor, row in rows.items():
                print(
                    f"{n_behind:>8} {window:7}{actor:12}{row['main']:12.1%}{row['busy']:8.1%}{row['sync']:8.1%}"
                    f"{row['idle']:11.1%}{wall:8.1f}"
                )
            producers = [row for actor, row in rows.items() if actor.startswith("producer")]
            trainers = [row for actor, row in rows.items() if actor.startswith("trainer")]
            results[n_behind, window] = (
                sum(r["main"] for r in producers) / len(producers),
                sum(1 - r["busy"] for r in producers) / len(producers),
                sum(r["main"] for r in trainers) / len(trainers),
            )
        print(f"{'':>8} (child process wall {child_wall:.0f} s)", flush=True)
    summary = "; ".join(
        f"n_behind={nb} {window}: producers generating {gen:.0%}, idle {idle:.0%}; trainers computing {comp:.0%}"
        for (nb, window), (gen, idle, comp) in results.items()
    )
    print(f"utilisation ({time.perf_counter() - started:.0f} s total): {summary}")


if __name__ == "__main__":
    main()
