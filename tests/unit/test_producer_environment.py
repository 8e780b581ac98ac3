"""``--env`` in the producer, on the embedded model, no Ray: a round's batch carries multi-turn episodes (the
environment's tokens in the responses, out of the policy mask) scored by their environment, with turn metrics,
and evaluation runs episodes too. Without ``--env`` the single-turn path runs (``test_producer_chunk.py``); it
gives what the one-step ``single_turn`` environment gives (responses, rewards, eval records)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from colossal_rl.config import EnvironmentConfig, GenerationConfig, RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.input_checks import InputError, check_inputs
from colossal_rl.reward.user_functions import PluginScorer
from colossal_rl.rollout.producer import Producer
from colossal_rl.schedule.prompts import EpisodeSchedule

GROUP_SIZE = 2


def produce_round(producer: Producer, round_index: int):
    """The producer's share of a round, as the round schedule orders it: its rows, sampling seeded by the round."""
    schedule = producer.config.schedule
    plan = EpisodeSchedule(
        len(producer.train_data), schedule.num_producers, schedule.inference_batch_size, producer.config.data.seed
    )
    chunk_id = round_index * schedule.num_producers + producer.rank
    chunk = producer.produce_chunk(chunk_id, plan.rows_for(round_index, producer.rank), seed_index=round_index)
    return chunk.batch, chunk.metrics


def config(env: str) -> RLConfig:
    return resolve(
        RLConfig(
            generation=GenerationConfig(num_generations=GROUP_SIZE, microbatch_size=2, max_new_tokens=8),
            environment=EnvironmentConfig(name=env, max_turns=3, max_total_tokens=96),
        )
    )


@pytest.fixture(scope="module")
def producer(tmp_path_factory) -> Producer:
    path = tmp_path_factory.mktemp("env") / "retry_env.py"
    path.write_text(
        "from colossal_rl.environments import StepResult\n"
        "class Retry:\n"
        "    def __init__(self, context):\n"
        "        self.context, self.turns = context, 0\n"
        "    def reset(self, row):\n"
        "        self.row = row\n"
        "        return [row['messages']]\n"
        "    def step(self, text):\n"
        "        self.turns += 1\n"
        "        if self.turns < 2:\n"
        "            return StepResult(observation=({'role': 'user', 'content': 'again'},))\n"
        "        record = self.context.reward_scorer.score_batch([text], [self.row])[0]\n"
        "        return StepResult(reward=record.reward, done=True, info={'status': record.status})\n"
    )
    scorer = PluginScorer(lambda response, row: float(len(response) % 2), "parity")
    return Producer(0, config(f"{path}:Retry"), reward_scorer=scorer)


def test_a_round_is_multi_turn_episodes_with_policy_masks(producer):
    batch, metrics = produce_round(producer, 0)
    assert batch is not None and batch.policy_mask is not None
    environment_tokens = batch.response_mask * (1 - batch.policy_mask)
    assert bool((environment_tokens.sum(1) > 0).all())  # every episode had its "again" turn
    assert bool((batch.behaviour_logprobs[environment_tokens.bool()] == 0).all())
    assert metrics["rollout/turns"] == 2.0 and metrics["rollout/end_done"] == 1.0
    assert set(batch.reward_status) == {"ok"} and batch.advantages is not None
    assert metrics["rollout/environment_tokens"] > 0


def test_evaluation_runs_episodes(producer):
    (result,) = producer.evaluate(num_producers=8)
    assert result.num_prompts > 0 and all(record["turns"] == 2 for record in result.records)


def test_the_env_spec_is_checked_before_ray_starts(tmp_path):
    check_inputs(config("calculator"))
    broken = tmp_path / "broken_env.py"
    broken.write_text(
        "class Env:\n    def reset(self, row):\n        return row['no such key']\n    def step(self, t): pass\n"
    )
    with pytest.raises(InputError, match="broken_env.py.*KeyError"):
        check_inputs(config(f"{broken}:Env"))
    with pytest.raises(InputError, match="unknown environment 'chess'"):
        check_inputs(config("chess"))


def test_vllm_engine_length_covers_a_whole_episode_or_the_run_is_refused_before_ray():
    """An episode grows to -mpt + --max-total-tokens; vLLM's engine (sized from that, capped by the model) must
    hold it, or the launch stops with the flags to change, not a turn failing mid-run."""
    base = config("calculator")  # the embedded model: 256 positions
    assert base.max_sequence_tokens == 512 + 96
    assert replace(base, environment=EnvironmentConfig()).max_sequence_tokens == 512 + 8  # single-turn: -mnt
    vllm = replace(base, generation=replace(base.generation, backend="vllm"))
    with pytest.raises(InputError, match=r"-mpt \+ --max-total-tokens = 512 \+ 96 = 608 tokens.* context of 256"):
        check_inputs(vllm)
    check_inputs(replace(vllm, data=replace(vllm.data, max_prompt_tokens=128)))  # 128 + 96 fits
    too_short = replace(vllm.generation, vllm=replace(vllm.generation.vllm, max_model_len=600))
    with pytest.raises(ValueError, match=r"max_model_len.*environment.max_total_tokens \(--env\) = 512 \+ 96 = 608"):
        replace(vllm, generation=too_short).validate()


def test_without_env_rounds_and_evals_equal_the_one_step_environments(tmp_path):
    """Today's single-turn run is the ``single_turn`` environment's special case: the default path (one batched
    generate, shared prompt prefill, batched scoring) and ``--env single_turn`` (one episode per sample through
    ``run_episodes``) give the same prompts, responses, rewards and eval records. Greedy (top-k 1) so that both
    sample the same tokens whatever their batch shapes."""
    from colossal_rl.config import EMBEDDED_EVAL_DATA, DataConfig
    from colossal_rl.reward import build_reward_scorer

    eval_rows = tmp_path / "eval.jsonl"  # the embedded eval set's first 24 rows
    eval_rows.write_text("".join(EMBEDDED_EVAL_DATA.read_text().splitlines(keepends=True)[:24]))
    generation = GenerationConfig(num_generations=GROUP_SIZE, microbatch_size=2, max_new_tokens=8, top_k=1)
    plain = resolve(RLConfig(generation=generation, data=DataConfig(eval_paths=(("math", str(eval_rows)),))))
    stepped = replace(plain, environment=EnvironmentConfig(name="single_turn", max_total_tokens=8))
    producers = [Producer(0, c, reward_scorer=build_reward_scorer(reward_type=c.reward.reward_type))
                 for c in (plain, stepped)]  # fmt: skip
    (batch, _), (episodes, _) = (produce_round(producer, 0) for producer in producers)
    assert episodes.policy_mask is not None and bool((episodes.policy_mask == episodes.response_mask).all())
    assert batch.prompts == episodes.prompts and batch.responses == episodes.responses
    assert batch.rewards.tolist() == episodes.rewards.tolist() and batch.reward_status == episodes.reward_status
    assert batch.advantages.tolist() == episodes.advantages.tolist()
    (plain_eval,), (stepped_eval,) = (producer.evaluate(1) for producer in producers)
    assert plain_eval.accuracy == stepped_eval.accuracy
    keys = ("index", "sample", "response", "reward", "correct", "status")
    assert [[r[k] for k in keys] for r in plain_eval.records] == [[r[k] for k in keys] for r in stepped_eval.records]
