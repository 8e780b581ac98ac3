"""How many rounds the round schedule plans (``driver/schedules.py``'s ``total_rounds``) and the steps its LR schedule
spans.

``--max-steps`` counts optimizer steps. Unfiltered, a round trains ``optimizer_steps_per_round`` of them, so the
rounds are capped at ``ceil(max_steps / per round)``. DAPO's dynamic sampling drops groups, so its rounds train
fewer: the rounds stay uncapped and the round scheduler stops once the steps are trained (``test_e2e_cpu.py`` drives a
real driver past the cap to check that), else a DAPO run with ``--max-steps 20`` trained 3-7 steps.
"""

import sys
from pathlib import Path

from colossal_rl.config import RLConfig
from colossal_rl.driver.schedules import planned_steps, total_rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rl_example.py: a script at the repo root
from rl_example import build_parser, config_from_args  # noqa: E402

ROWS = 2_000  # the embedded training set: 125 rounds of -ibs 16


def config(preset: str, max_steps: int | None) -> RLConfig:
    argv = ["-a", preset] + ([] if max_steps is None else ["--max-steps", str(max_steps)])
    return config_from_args(build_parser().parse_args(argv))


def test_max_steps_caps_unfiltered_rounds_at_whole_rounds():
    grpo = config("GRPO", 7)
    assert grpo.algorithm.filter_range is None and grpo.optimizer_steps_per_round == 1
    assert total_rounds(grpo, ROWS) == 7
    assert total_rounds(config("GRPO", None), ROWS) == 125
    assert planned_steps(grpo, total_rounds(grpo, ROWS)) == 7


def test_dynamic_sampling_keeps_every_round_and_the_lr_schedule_ends_at_max_steps():
    dapo = config("DAPO", 20)
    assert dapo.algorithm.filter_range is not None
    assert total_rounds(dapo, ROWS) == 125  # the driver stops at 20 trained steps, not after 20 rounds
    assert planned_steps(dapo, total_rounds(dapo, ROWS)) == 20
    assert total_rounds(config("DAPO", None), ROWS) == 125
