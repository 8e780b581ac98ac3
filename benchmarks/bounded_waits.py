"""How long the bounded waits take: what the tests used to assert with wall-clock limits, measured instead.

Tests check behaviour (a hostile program scores 0 with a ``timeout`` verdict, an input error exits 2 before
Ray starts, ...); how long that takes depends on the machine's load, so it is measured here, side by side:

- ``sandbox``: hostile programs (fork bombs, an infinite loop, a memory bomb, a signal-ignoring loop) through
  the code scorer with a 2 s timeout, and a trivial program; the time from submission to verdict, as a
  multiple of the timeout.
- ``math``: a pathological LaTeX answer through the math scorer (2 s timeout) vs an ordinary one.
- ``cli``: ``rl_example.py`` reporting a missing dataset, in a fresh interpreter, vs ``rl_example.py --help``.
- ``layouts`` (``--layouts``, ~2 min): two gloo processes building each consumer layout and training 3 steps
  on the embedded model (boost, steps, full-state gather), vs the DDP layout.

    python benchmarks/bounded_waits.py [--repeats 3] [--layouts]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0

HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork_bomb_resilient": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "infinite_loop": "while True:\n    pass\n",
    "memory_bomb": "hoard = []\nwhile True:\n    hoard.append(bytearray(64 << 20))\n",
    "ignores_signals": textwrap.dedent(
        """\
        import signal
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
        """
    ),
    "trivial (reference)": "print(input())\n",
}


def timed(function, repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def sandbox_verdicts(repeats: int) -> dict[str, float]:
    from colossal_rl.reward import build_reward_scorer

    scorer = build_reward_scorer("code", timeout_s=TIMEOUT_S, max_parallel=2, early_stop=False, memory_mb=256)
    try:
        tests = [{"test_cases": {"inputs": ["1\n", "2\n"], "outputs": ["1", "2"]}}]
        return {
            name: timed(lambda program=program: scorer.score_batch([f"```python\n{program}```"], tests), repeats)
            for name, program in HOSTILE.items()
        }
    finally:
        scorer.close()


def math_verdicts(repeats: int) -> dict[str, float]:
    from colossal_rl.reward import build_reward_scorer

    scorer = build_reward_scorer("boxed", timeout_s=TIMEOUT_S, num_workers=2)
    try:
        scorer.score_batch([r"\boxed{0.5}"], [{"gt_answer": "1/2"}])  # workers are up
        return {
            "pathological LaTeX": timed(
                lambda: scorer.score_batch([r"\boxed{10^{10^{10^{10}}}}"], [{"gt_answer": "1"}]), repeats
            ),
            "ordinary (reference)": timed(
                lambda: scorer.score_batch([r"\boxed{0.25}"], [{"gt_answer": "1/4"}]), repeats
            ),
        }
    finally:
        scorer.close()


def cli_times(repeats: int) -> dict[str, float]:
    def run(*argv: str) -> None:
        subprocess.run([sys.executable, "rl_example.py", *argv], cwd=REPO, capture_output=True, timeout=300)

    with tempfile.TemporaryDirectory() as directory:
        missing = str(Path(directory) / "missing.jsonl")
        return {
            "missing dataset -> exit 2": timed(lambda: run("-d", missing, "--no-wandb"), repeats),
            "--help (reference)": timed(lambda: run("--help"), repeats),
        }


# --------------------------------------------------------------------------- layouts
LAYOUT_STEPS = 3


def _layouts():
    from colossal_rl.config import ParallelConfig

    return {
        "ddp": ParallelConfig(num_trainers=2),
        "zero1": ParallelConfig(num_trainers=2, zero_stage=1),
        "zero2": ParallelConfig(num_trainers=2, zero_stage=2),
        "tp2": ParallelConfig(num_trainers=2, tp_size=2),
        "pp2": ParallelConfig(num_trainers=2, pp_size=2),
        "hybrid_zero1_dp2": ParallelConfig(num_trainers=2, zero_stage=1, precision="bf16"),
    }


def _batch(vocab_size: int, seed: int):
    import torch

    from colossal_rl.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    n, prompt_len, response_len = 8, 6, 5
    rewards = torch.randint(0, 2, (n,), generator=generator).float()
    return RolloutBatch(
        prompt_ids=torch.randint(1, vocab_size, (n, prompt_len), generator=generator),
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.long),
        response_ids=torch.randint(1, vocab_size, (n, response_len), generator=generator),
        response_mask=torch.ones(n, response_len, dtype=torch.long),
        behaviour_logprobs=-torch.rand(n, response_len, generator=generator),
        rewards=rewards,
        answer_correct=rewards,
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.randn(n, generator=generator),
        group_size=4,
        policy_version=0,
    )


def _layout_worker(rank: int, port: int, out_dir: str) -> None:
    import json

    import torch

    from colossal_rl.config import AlgorithmConfig, RLConfig, TrainConfig
    from colossal_rl.training.booster_plugins import launch_colossalai, make_hybrid_plugin
    from colossal_rl.training.engines.colossalai_engine import ColossalAIEngine
    from colossal_rl.training.trainer import Trainer

    torch.set_num_threads(1)
    launch_colossalai(rank, 2, "127.0.0.1", port, on_cpu=True)
    seconds = {}
    for name, parallel in _layouts().items():
        config = RLConfig(
            algorithm=AlgorithmConfig(kl_coeff=0.1),
            train=TrainConfig(learning_rate=1e-3, microbatch_size=4, max_norm=1.0),
            parallel=parallel,
        )
        started = time.perf_counter()
        plugin = None
        if name == "hybrid_zero1_dp2":  # the hybrid plugin, where make_plugin would choose LowLevelZero
            plugin = make_hybrid_plugin(parallel, microbatch_size=4, max_norm=1.0, on_cpu=True)
        trainer = Trainer(rank, 2, config, "127.0.0.1", port)
        trainer.build(ColossalAIEngine(config, plugin=plugin))
        for step in range(LAYOUT_STEPS):
            batch = _batch(trainer.vocab_size, step)
            groups = list(range(trainer.dp_rank, batch.num_groups, trainer.dp_size))
            trainer.train_step(batch.select_groups(groups))
        trainer.full_state_dict()
        seconds[name] = time.perf_counter() - started
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seconds))


def layout_times() -> dict[str, float]:
    import json
    import multiprocessing

    from colossal_rl.comm.process_group import find_free_port

    port = find_free_port()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        workers = [context.Process(target=_layout_worker, args=(rank, port, out_dir)) for rank in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=900)
            if worker.exitcode != 0:
                raise RuntimeError(f"a layout worker failed (exit code {worker.exitcode})")
        return json.loads(Path(out_dir, "rank0.json").read_text())


# --------------------------------------------------------------------------- report
def report(title: str, times: dict[str, float], unit: float | None = None, reference: str | None = None) -> str:
    print(f"\n{title}")
    for name, seconds in times.items():
        extra = f"  x{seconds / unit:.2f} of the {unit:g} s timeout" if unit else ""
        if reference and name != reference:
            extra += f"  x{seconds / times[reference]:.2f} of {reference.split(' (')[0]}"
        print(f"  {name:30} {seconds:7.2f} s{extra}")
    worst = max((seconds for name, seconds in times.items() if name != reference), default=0.0)
    base = unit or times[reference]
    return f"{title.split(':')[0]} worst x{worst / base:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs per case")
    parser.add_argument("--layouts", action="store_true", help="also time the six consumer layouts (~2 min)")
    args = parser.parse_args()
    started = time.perf_counter()
    ratios = [
        report("sandbox: submission to verdict", sandbox_verdicts(args.repeats), unit=TIMEOUT_S),
        report("math: submission to verdict", math_verdicts(args.repeats), unit=TIMEOUT_S),
        report("cli: fresh interpreter", cli_times(args.repeats), reference="--help (reference)"),
    ]
    if args.layouts:
        times = layout_times()
        ratios.append(report("layouts: boost + 3 steps + gather (rank 0)", times, reference="ddp"))
    print(f"\n{'; '.join(ratios)} ({time.perf_counter() - started:.0f} s in total)")


if __name__ == "__main__":
    main()
