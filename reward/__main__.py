"""Command line: ``python -m colossal_rl.reward score ...`` and ``python -m colossal_rl.reward check-sandbox``.

``score`` reads a jsonl of ``{"response": ..., "gt_answer": ...}`` (or ``"test_cases"``) rows and
writes one JSON record per row (reward, status, format_ok, answer_ok, details) to ``--output``
or stdout. ``check-sandbox`` runs a trivial program in the code sandbox and exits non-zero,
saying why, if it cannot.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from .factory import REWARD_TYPES, build_reward_scorer
from .user_functions import RewardConfigError

logger = logging.getLogger("colossal_rl.reward")

BATCH_SIZE = 64


class InputError(ValueError):
    """The input jsonl is malformed; the message names the file and line."""


def read_rows(path: Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, response, row without the response) for every non-blank line."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{line_number}: invalid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
            response = row.pop("response", None)
            if not isinstance(response, str):
                raise InputError(f"{path}:{line_number}: missing string field 'response'")
            yield line_number, response, row


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _batches(rows: Iterator[tuple[int, str, dict[str, Any]]]) -> Iterator[list[tuple[int, str, dict[str, Any]]]]:
    batch = []
    for item in rows:
        batch.append(item)
        if len(batch) == BATCH_SIZE:
            yield batch
            batch = []
    if batch:
        yield batch


def score_file(args: argparse.Namespace) -> int:
    rows = list(read_rows(Path(args.input)))  # all of the input is checked before anything is scored
    options = dict(args.option or [])
    scorer = build_reward_scorer(args.reward_type, args.code_verifier_url, args.reward_fn, **options)
    output = open(args.output, "w", encoding="utf-8") if args.output else nullcontext(sys.stdout)
    scored = 0
    try:
        with output as handle:
            for batch in _batches(iter(rows)):
                records = scorer.score_batch([b[1] for b in batch], [b[2] for b in batch])
                for (line_number, _, _), record in zip(batch, records, strict=True):
                    handle.write(json.dumps({"line": line_number, **record.to_json()}) + "\n")
                scored += len(batch)
    finally:
        scorer.close()
    logger.info("scored %d rows", scored)
    return 0


def check_sandbox(args: argparse.Namespace) -> int:
    from .sandbox import Sandbox, SandboxConfig

    problem = Sandbox(SandboxConfig(timeout_s=args.timeout_s)).self_test()
    sys.stdout.write(json.dumps({"ok": problem is None, "error": problem}) + "\n")
    return 0 if problem is None else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m colossal_rl.reward", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser("score", help="score a jsonl of responses")
    score.add_argument("--reward-type", choices=REWARD_TYPES, required=True)
    score.add_argument("--input", required=True, help="jsonl rows with 'response' and 'gt_answer' or 'test_cases'")
    score.add_argument("--output", help="where to write the records (default: stdout)")
    score.add_argument("--reward-fn", help="user plug-in path/to/file.py:function or module:function")
    score.add_argument("--code-verifier-url", help="remote verifier for --reward-type code")
    score.add_argument(
        "--option",
        action="append",
        type=_parse_option,
        metavar="KEY=VALUE",
        help="scorer option, e.g. timeout_s=3 (repeatable; VALUE is JSON or a string)",
    )
    score.set_defaults(handler=score_file)
    check = commands.add_parser("check-sandbox", help="run a trivial program in the code sandbox")
    check.add_argument("--timeout-s", type=float, default=10.0)
    check.set_defaults(handler=check_sandbox)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except (InputError, RewardConfigError) as error:
        logger.error("%s", error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
