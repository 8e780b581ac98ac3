"""Every wait of the trainers' collectives is bounded by ``--timeout`` (issue 33, items 6 and 10)."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch.distributed as dist

from colossal_rl.config import RLConfig


class Recorded(Exception):
    pass


def test_the_trainers_process_group_gets_the_runs_timeout(monkeypatch):
    """Without one, torch's default (10 minutes) bounds ColossalAI's collectives whatever --timeout says."""
    import colossal_rl.training.booster_plugins as booster_plugins
    from colossal_rl.training.trainer import Trainer

    def record(**kwargs):
        raise Recorded(kwargs)

    monkeypatch.setattr(booster_plugins.dist, "init_process_group", record)
    config = RLConfig()
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, timeout_s=1234.0))
    with pytest.raises(Recorded) as recorded:
        Trainer(0, 1, config, "127.0.0.1", 0).setup()
    assert recorded.value.args[0]["timeout"] == datetime.timedelta(seconds=1234.0)
