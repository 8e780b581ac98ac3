"""docs/reference/flags.md is what scripts/write_flag_reference.py writes from colossal_rl/flags.py: the flags have
one source, and a new or changed flag fails here until the page is rewritten."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import write_flag_reference  # noqa: E402

from colossal_rl.flags import FLAGS  # noqa: E402


def test_the_committed_flag_page_is_current():
    assert write_flag_reference.PAGE.read_text(encoding="utf-8") == write_flag_reference.page(), (
        "docs/reference/flags.md is out of date: run python scripts/write_flag_reference.py"
    )
    assert write_flag_reference.main(["--check"]) == 0


def test_the_page_lists_every_flag_once():
    page = write_flag_reference.page()
    for flag in FLAGS:
        row = f"| {write_flag_reference.shown_names(flag)} | `{flag.field}` |"
        assert page.count(row) == 1, flag.names
    assert "/work/" not in page and str(REPO_ROOT) not in page  # defaults shown relative to the checkout
