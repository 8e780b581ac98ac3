"""Pulling the answer (or the program) out of a response, and normalising answers for string comparison.

Pure string functions, no math-verify and no subprocesses: cheap enough to run in the caller's
thread for every sample. Everything here is linear in the response length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN_RE = re.compile(r"[^\s$]+")


def _matching_braces(text: str) -> dict[int, int]:
    """Index of every ``{`` that closes -> index of its ``}``, in one pass (escaped ``\\{``, ``\\}`` do not count)."""
    matches: dict[int, int] = {}
    open_stack: list[int] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            open_stack.append(index)
        elif char == "}" and open_stack:
            matches[open_stack.pop()] = index
        index += 1
    return matches


def find_boxed(text: str) -> list[str]:
    """Contents of every brace-balanced ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``) in order.

    Linear in the text however many unclosed boxes it has.
    """
    if "\\boxed" not in text and "\\fbox" not in text:
        return []
    braces = _matching_braces(text)
    found: list[str] = []
    for match in _BOX_RE.finditer(text):
        start = match.end()
        while start < len(text) and text[start] == " ":
            start += 1
        if start < len(text) and text[start] == "{":
            if start in braces:
                found.append(text[start + 1 : braces[start]])
        elif start > match.end() and start < len(text) and text[start].isalnum():  # "\boxed 5"
            found.append(_BARE_TOKEN_RE.match(text, start).group(0))
    return found


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``."""
    close = text.rfind("</answer>")
    open_ = text.rfind("<answer>", 0, close) if close >= 0 else -1
    return text[open_ + len("<answer>") : close] if open_ >= 0 else None


def has_think_answer_shape(text: str) -> bool:
    """``<think>...</think><answer>...</answer>`` exactly once each, in that order, nothing outside but whitespace."""
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        if text.count(tag) != 1:
            return False
    stripped = text.strip()
    if not (stripped.startswith("<think>") and stripped.endswith("</answer>")):
        return False
    think_end = stripped.index("</think>")
    answer_start = stripped.index("<answer>")
    return think_end < answer_start and not stripped[think_end + len("</think>") : answer_start].strip()


_PYTHON_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n", re.IGNORECASE)


def last_python_block(text: str) -> str | None:
    """The last fenced ```python (or ```py, ```python3) block's code."""
    last = None
    position = 0
    while (header := _PYTHON_FENCE_RE.search(text, position)) is not None:
        end = text.find("```", header.end())
        if end < 0:  # unclosed: no later block can close either
            break
        last = text[header.end() : end]
        position = end + 3
    return last


# ------------------------------------------------------------------ normalisation
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_MAX_UNWRAP_DEPTH = 4
_SPACING_RE = re.compile(r"\\[!,;:> ]|\\q?quad|~")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def normalize_answer(answer: str) -> str:
    """Conservative normalisation: only rewrites that never change the meaning of an answer.

    Used for the fast path (equal after this means equal) and to tell boxed answers apart.
    """
    text = answer.strip()
    for opening, closing in _DELIMITERS:
        if text.startswith(opening) and text.endswith(closing) and len(text) >= len(opening) + len(closing):
            text = text[len(opening) : len(text) - len(closing)].strip()
    for _ in range(_MAX_UNWRAP_DEPTH):  # bounded: deep nesting must not cost quadratic time
        unwrapped = _WRAPPER_RE.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = _SPACING_RE.sub("", text)
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def normalize_for_fallback(answer: str) -> str:
    """Aggressive normalisation for when math-verify cannot parse: also drops case, units signs and braces."""
    text = normalize_answer(answer).lower()
    for token in ("^\\circ", "^{\\circ}", "\\%", "%", "\\$", "$", "{", "}"):
        text = text.replace(token, "")
    return text


HEDGE_RE = re.compile(r"\b(?:or|either|maybe|possibly|perhaps)\b", re.IGNORECASE)


@dataclass(frozen=True)
class ExtractedAnswer:
    answer: str | None
    """The final answer (without ``\\boxed``); None if there is none."""
    format_ok: bool
    candidates: tuple[str, ...] = ()
    """Every distinct final answer given (normalised); more than one makes the response ambiguous."""


def extract_boxed_answer(response: str) -> ExtractedAnswer:
    boxed = find_boxed(response)
    if not boxed:
        return ExtractedAnswer(None, False)
    distinct = tuple(dict.fromkeys(normalize_answer(b) for b in boxed))
    return ExtractedAnswer(boxed[-1], True, distinct)


def extract_tagged_answer(response: str) -> ExtractedAnswer:
    content = last_answer_tag(response)
    format_ok = has_think_answer_shape(response)
    if content is None:
        return ExtractedAnswer(None, format_ok)
    boxed = find_boxed(content)
    if boxed:
        distinct = tuple(dict.fromkeys(normalize_answer(b) for b in boxed))
        return ExtractedAnswer(boxed[-1], format_ok, distinct)
    return ExtractedAnswer(content.strip(), format_ok, (normalize_answer(content),))
