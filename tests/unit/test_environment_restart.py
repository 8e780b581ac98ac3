"""A producer that dies mid-episode (``--env``) loses nothing: the restarted producer's redo of the call (what
``--max-actor-restarts`` does: a fresh process, the same call again) is exactly what an uninterrupted producer
makes — the same rows, every token, mask, log-prob and reward. Embedded model, transformers backend, no Ray: the
death is an exception no environment handler catches, raised from inside an episode's second turn."""

from __future__ import annotations

import pytest
import torch

from colossal_rl.config import EnvironmentConfig, GenerationConfig, RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.reward.user_functions import PluginScorer
from colossal_rl.rollout.producer import Producer

ENVIRONMENT = """
from pathlib import Path
from colossal_rl.environments import StepResult

CRASH = Path(__file__).with_name("crash")


class ProcessDied(BaseException):
    '''Stands for the producer's process dying: no ``except Exception`` in the rollout catches it.'''


class TwoTurns:
    def __init__(self, context):
        self.context, self.turns = context, 0

    def reset(self, row):
        self.row = row
        return [row["messages"]]

    def step(self, text):
        self.turns += 1
        if self.turns < 2:
            return StepResult(observation=({"role": "user", "content": "again"},))
        if CRASH.exists():
            CRASH.unlink()
            raise ProcessDied("the producer died mid-episode")
        record = self.context.reward_scorer.score_batch([text], [self.row])[0]
        return StepResult(reward=record.reward, done=True, info={"status": record.status})
"""


@pytest.fixture(scope="module")
def environment_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("restart") / "two_turns.py"
    path.write_text(ENVIRONMENT)
    return path


def fresh_producer(environment_file) -> Producer:
    """A producer as a (re)started actor makes it: a new object from the run's config, rank 0."""
    config = resolve(
        RLConfig(
            generation=GenerationConfig(num_generations=2, microbatch_size=2, max_new_tokens=8),
            environment=EnvironmentConfig(name=f"{environment_file}:TwoTurns", max_turns=3, max_total_tokens=96),
        )
    )
    return Producer(0, config, reward_scorer=PluginScorer(lambda response, row: float(len(response) % 2), "parity"))


def assert_same_batch(redone, uninterrupted) -> None:
    assert redone.data_indices == uninterrupted.data_indices and redone.responses == uninterrupted.responses
    for name in ("prompt_ids", "response_ids", "response_mask", "policy_mask", "rewards", "advantages"):
        assert torch.equal(getattr(redone, name), getattr(uninterrupted, name)), name
    torch.testing.assert_close(redone.behaviour_logprobs, uninterrupted.behaviour_logprobs, rtol=0, atol=1e-6)
    assert bool(uninterrupted.policy_mask.sum() < uninterrupted.response_mask.sum())  # the environment's tokens


def test_a_chunk_redone_after_a_death_mid_episode_equals_the_uninterrupted_chunk(environment_file):
    """``produce_chunk`` (streaming); ``produce`` (rounds) runs the same ``_rollout`` on its round's rows."""
    uninterrupted = fresh_producer(environment_file).produce_chunk(3, [5, 9]).batch
    (environment_file.parent / "crash").touch()
    with pytest.raises(BaseException, match="died mid-episode"):
        fresh_producer(environment_file).produce_chunk(3, [5, 9])
    assert not (environment_file.parent / "crash").exists()  # it did die inside an episode
    assert_same_batch(fresh_producer(environment_file).produce_chunk(3, [5, 9]).batch, uninterrupted)
