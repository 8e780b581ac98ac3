"""Build issue 35's long-tail task (b): the default addition prompts plus a few whose responses run long.

Writes, deterministically (a fixed seed, no model needed), ``colossal_rl/assets/long_tail/{train,eval}.jsonl``:

* every row of ``colossal_rl/assets/data/train.jsonl``, its messages now carrying the "boxed" system prompt
  itself: the embedded model answers these in ~10-15 tokens, as in the default task;
* ``LONG_FRACTION`` more rows (interleaved at random): ``<d repeated 24-40 times>+<digit>=?`` with no system
  prompt, which the embedded model answers by copying digits without ending: it runs to ``-mnt`` (the right
  answer needs 25-41 tokens too). Their reward is almost always 0, so they cost generation time and teach little:
  the shape of a long tail.
* ``eval.jsonl``: the default eval rows, with the system prompt in their messages (accuracy comparable to (a)).

Run with ``-s ""`` (no run-wide system prompt: each row brings its own), e.g.
``python rl_example.py -d colossal_rl/assets/long_tail/train.jsonl -ed colossal_rl/assets/long_tail/eval.jsonl
-s "" -mnt 96``. ``benchmarks/stream_long_tail.py`` does.

Usage: ``python scripts/build_long_tail_task.py [--output-dir DIR]`` (well under a second).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "colossal_rl" / "assets" / "data"
LONG_FRACTION = 0.125
"""Long rows per default row (one in nine rows of the mix)."""
SEED = 35


def with_system_prompt(row: dict) -> dict:
    user = row["messages"] if isinstance(row["messages"], list) else [row["messages"]]
    system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPTS["boxed"]}
    return {"gt_answer": row["gt_answer"], "messages": [system, *user]}


def long_row(rng: random.Random) -> dict:
    digit, count, addend = rng.randint(1, 8), rng.randint(24, 40), rng.randint(0, 9)
    number = int(str(digit) * count)
    question = f"{number}+{addend}=?"
    return {"gt_answer": str(number + addend), "messages": [{"role": "user", "content": question}]}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")


def build(output_dir: Path) -> tuple[int, int]:
    rng = random.Random(SEED)
    train = [with_system_prompt(row) for row in read_jsonl(SOURCE / "train.jsonl")]
    long_rows = [long_row(rng) for _ in range(int(len(train) * LONG_FRACTION))]
    for row in long_rows:
        train.insert(rng.randint(0, len(train)), row)
    write_jsonl(output_dir / "train.jsonl", train)
    write_jsonl(output_dir / "eval.jsonl", [with_system_prompt(row) for row in read_jsonl(SOURCE / "eval.jsonl")])
    return len(train), len(long_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=REPO / "colossal_rl" / "assets" / "long_tail")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows, long_rows = build(args.output_dir)
    logger.info("wrote %s: %d training rows (%d long)", args.output_dir, rows, long_rows)


if __name__ == "__main__":
    main()
