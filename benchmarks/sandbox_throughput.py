"""Throughput of the code sandbox vs bare subprocesses, side by side in one run.

A trivial program with 10 test cases is judged ``--programs`` times per round, once through
the sandbox (LocalCodeRunner: setpriv + prlimit + bwrap + launcher, with output judging) and
once with a bare ``subprocess.run`` of the same interpreter per case (same parallelism, same
comparison). Rounds alternate between the two so machine noise hits both alike; the last line
is the ratio of their median times.

    python benchmarks/sandbox_throughput.py [--programs 20] [--rounds 3] [--parallel 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from colossal_rl.reward.code_runner import LocalCodeRunner, ProgramJob
from colossal_rl.reward.code_tests import TestCases, normalized_lines
from colossal_rl.reward.sandbox import SandboxConfig

PROGRAM = "print(int(input()) * 2)\n"
TESTS = TestCases(inputs=[f"{i}\n" for i in range(10)], outputs=[f"{2 * i}\n" for i in range(10)])


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sandbox_round(runner: LocalCodeRunner, programs: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child processes) to judge ``programs`` programs."""
    started, cpu_started = time.perf_counter(), children_cpu_s()
    reports = runner.run_programs([ProgramJob(PROGRAM, TESTS)] * programs)
    elapsed, cpu = time.perf_counter() - started, children_cpu_s() - cpu_started
    assert all(r.passed == r.total for r in reports), reports[0]
    return elapsed, cpu


def bare_round(python: str, program_path: Path, executor: ThreadPoolExecutor, programs: int) -> tuple[float, float]:
    def run_case(index: int) -> bool:
        result = subprocess.run(
            [python, "-I", "-S", "-B", str(program_path)], input=TESTS.inputs[index].encode(), capture_output=True
        )
        return normalized_lines(result.stdout.decode()) == normalized_lines(TESTS.outputs[index])

    started, cpu_started = time.perf_counter(), children_cpu_s()
    verdicts = list(executor.map(run_case, [i for _ in range(programs) for i in range(len(TESTS.inputs))]))
    elapsed, cpu = time.perf_counter() - started, children_cpu_s() - cpu_started
    assert all(verdicts)
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=20, help="programs per round (10 test cases each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=2, help="test cases running at once, in both modes")
    args = parser.parse_args()

    runner = LocalCodeRunner(SandboxConfig(max_parallel=args.parallel))
    problem = runner.sandbox.self_test()
    if problem:
        raise SystemExit(f"sandbox unavailable: {problem}")
    python = runner.sandbox.python  # the same interpreter the sandbox runs
    sandbox, bare = [], []  # (wall s, cpu s) per round
    with tempfile.TemporaryDirectory() as directory, ThreadPoolExecutor(args.parallel) as executor:
        program_path = Path(directory) / "prog.py"
        program_path.write_text(PROGRAM)
        bare_round(python, program_path, executor, 1)  # warm-up of both paths
        sandbox_round(runner, 1)
        for round_index in range(args.rounds):
            sandbox.append(sandbox_round(runner, args.programs))
            bare.append(bare_round(python, program_path, executor, args.programs))
            print(
                f"round {round_index}: sandbox {args.programs / sandbox[-1][0]:7.2f} programs/s   "
                f"bare {args.programs / bare[-1][0]:7.2f} programs/s"
            )
    runner.close()
    cases = args.programs * len(TESTS.inputs)
    print(f"{'':10}{'programs/s':>12}{'ms/case':>10}{'cpu ms/case':>13}   ({args.parallel} in parallel, {python})")
    medians = {}
    for name, rounds in (("sandbox", sandbox), ("bare", bare)):
        wall, cpu = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        medians[name] = (wall, cpu)
        print(f"{name:10}{args.programs / wall:12.2f}{1000 * wall / cases:10.1f}{1000 * cpu / cases:13.1f}")
    wall_ratio = medians["sandbox"][0] / medians["bare"][0]
    cpu_ratio = medians["sandbox"][1] / medians["bare"][1]
    print(f"sandbox/bare ratio: time {wall_ratio:.2f}, cpu {cpu_ratio:.2f}")


if __name__ == "__main__":
    main()
