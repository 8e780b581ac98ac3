"""Start-up side by side: two checkouts run the same short job in alternation, each printing where its
time to the first round of rollouts went (``<run dir>/startup.json``, written by every run).

    python benchmarks/startup.py --before <commit>                # 2 pairs of `rl_example.py --max-steps 4`
    python benchmarks/startup.py --before <commit> --pairs 3 -- -t 2 -i 2

``--before`` is checked out into a temporary git worktree; "after" is this checkout. Both run with this
interpreter, each importing its own ``colossal_rl`` (PYTHONPATH, inherited by the Ray workers). The
``before`` commit must already write ``startup.json`` (the commit that added the breakdown or later).
Runs alternate (before, after, after, before, ...) so drift on a shared machine falls on both. Metrics go
where a user's would: wandb offline unless WANDB_MODE says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.startup import phase_seconds_from_json, read_startup  # noqa: E402


def _worktree(ref: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), ref], check=True, capture_output=True
    )
    return into


def _run(checkout: Path, save_dir: Path, max_steps: int, extra: list[str]) -> dict:
    save_dir.mkdir(parents=True)
    command = [sys.executable, "rl_example.py", "--max-steps", str(max_steps), "-sd", str(save_dir), *extra]
    env = {**os.environ, "PYTHONPATH": str(checkout), "RAY_AUTH_MODE": "disabled"}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{checkout}: rl_example.py failed ({result.returncode}):\n{result.stderr[-3000:]}")
    (run_dir,) = [p for p in save_dir.iterdir() if p.is_dir()]
    record = read_startup(run_dir)
    return {"wall_s": wall, "first_rollout_s": record["time_to_first_rollout_s"], "record": record}


def _breakdown(record: dict) -> dict[str, dict[str, float]]:
    return {actor: phase_seconds_from_json(record, actor) for actor in record["actors"]}


def _print_breakdowns(label: str, runs: list[dict]) -> None:
    """Mean seconds per phase per actor over the runs of one checkout."""
    print(f"\n{label}: mean seconds per start-up phase over {len(runs)} runs")
    per_actor: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for actor, phases in _breakdown(run["record"]).items():
            for phase, seconds in phases.items():
                per_actor.setdefault(actor, {}).setdefault(phase, []).append(seconds)
    for actor, phases in per_actor.items():
        cells = " | ".join(f"{phase} {sum(v) / len(v):.2f}" for phase, v in phases.items())
        print(f"  {actor:<11} {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git commit to compare against (writes startup.json)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument("extra", nargs="*", help="flags for both runs of rl_example.py (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        tmp = Path(tmp)
        checkouts = {"before": _worktree(args.before, tmp / "before"), "after": REPO}
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        try:
            for pair in range(args.pairs):
                order = ["before", "after"] if pair % 2 == 0 else ["after", "before"]
                for label in order:
                    run = _run(checkouts[label], tmp / f"{label}-{pair}", args.max_steps, args.extra)
                    runs[label].append(run)
                    print(
                        f"pair {pair + 1} {label:<6} first rollout {run['first_rollout_s']:6.1f}s   "
                        f"whole run {run['wall_s']:6.1f}s",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp / "before")], check=False)
    for label in ("before", "after"):
        _print_breakdowns(f"{label} ({args.before})" if label == "before" else "after (this checkout)", runs[label])
    print("\nafter / before, per pair:")
    for pair, (before, after) in enumerate(zip(runs["before"], runs["after"], strict=True)):
        print(
            f"  pair {pair + 1}: first rollout {after['first_rollout_s'] / before['first_rollout_s']:.2f}x "
            f"({before['first_rollout_s']:.1f}s -> {after['first_rollout_s']:.1f}s), "
            f"whole run {after['wall_s'] / before['wall_s']:.2f}x ({before['wall_s']:.1f}s -> {after['wall_s']:.1f}s)"
        )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
