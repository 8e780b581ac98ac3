"""Checks on rendered figures, shared by the plot tests (``tests`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

PLOT_CURVES = {"reward", "accuracy", "eval_accuracy", "response_length", "kl"}
"""The figures every run's metrics yield."""


def assert_pngs(out_dir: Path, stems: set[str]) -> None:
    assert {path.stem for path in out_dir.glob("*.png")} == stems
    for stem in stems:
        path = out_dir / f"{stem}.png"
        assert path.stat().st_size > 0
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0
            image.verify()
