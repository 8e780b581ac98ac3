"""Math-equivalence worker process: ``python -m colossal_rl.reward.math_worker PARENT_PID``.

Reads one JSON request per line on stdin (``{"gold": str, "answer": str}``) and writes one JSON
reply per line on stdout. It has no timeout of its own: math-verify's timeouts rely on
``signal.alarm``; the parent (:mod:`colossal_rl.reward.math_pool`) kills and replaces this
process instead when an answer takes too long. It exits when stdin closes and dies with its parent
(``worker_lifetime.py``).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any

from .worker_lifetime import die_with_parent

RELATIVE_TOLERANCE = 1e-3
"""After math-verify says equal, two numbers further apart than this (relatively) are still unequal.

math-verify rounds to 6 decimals, which makes e.g. ``1/2004!`` equal to ``1/2006!`` (both round to 0).
"""


def _parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # LaTeX first: the expression parser reads ``1/2004!`` as 1.
    parsed = parse(f"${text}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if not _has_expression(parsed):
        parsed = parse(text, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
    # With nothing parsed, math-verify still returns the raw string: that is a failure to parse here.
    return parsed if _has_expression(parsed) else []


def _has_expression(parsed: list) -> bool:
    return any(not isinstance(item, str) for item in parsed)


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str) -> list:
    return _parse(text)


def _numerically_distinct(gold: Any, answer: Any) -> bool:
    """True if both are numbers whose relative difference exceeds :data:`RELATIVE_TOLERANCE`."""
    import sympy

    if not (isinstance(gold, sympy.Expr) and isinstance(answer, sympy.Expr)):
        return False
    if not (gold.is_number and answer.is_number):
        return False
    difference = sympy.N(sympy.Abs(gold - answer), 30)
    scale = sympy.Max(sympy.N(sympy.Abs(gold), 30), sympy.N(sympy.Abs(answer), 30))
    if not (difference.is_real and scale.is_real):
        return False
    return bool(difference > RELATIVE_TOLERANCE * scale)


def check(gold: str, answer: str) -> dict[str, Any]:
    """``{"parsed": False}`` if either side cannot be parsed, else ``{"parsed": True, "correct": bool, ...}``."""
    from math_verify import verify

    gold_parsed = _parse_gold(gold)
    answer_parsed = _parse(answer)
    if not gold_parsed or not answer_parsed:
        return {"parsed": False, "gold_parsed": bool(gold_parsed), "answer_parsed": bool(answer_parsed)}
    correct = verify(gold_parsed, answer_parsed, timeout_seconds=None)
    if correct and _numerically_distinct(gold_parsed[0], answer_parsed[0]):
        correct = False
    return {"parsed": True, "correct": bool(correct), "gold_expr": str(gold_parsed[0])[:200]}


def main() -> None:
    protocol = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies may reach the protocol stream
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    die_with_parent(int(sys.argv[1]))  # even stuck in sympy's C code holding the GIL (worker_lifetime.py)
    import math_verify  # noqa: F401  (imported before "ready" so the first answer is not charged for it)
    import sympy  # noqa: F401

    protocol.write(json.dumps({"ready": True}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = check(str(request["gold"]), str(request["answer"]))
        except Exception as error:  # any failure is reported; the worker stays up
            reply = {"error": f"{type(error).__name__}: {error}"[:500]}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


if __name__ == "__main__":
    main()
