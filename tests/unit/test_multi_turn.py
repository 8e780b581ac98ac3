"""Multi-turn rollouts with a scripted backend: the token sequence and its masks are exact, malformed calls become
observations, and turn, token and environment failures end an episode, never the rollout.

The backend is a fake (it replies with scripted texts); the chat rendering, the environments and the rollout
loop are the real ones, on the embedded tiny model's tokenizer. ``test_multi_turn_training.py`` runs the real
model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoTokenizer

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.environments import EnvironmentContext, environment_factory
from colossal_rl.reward.user_functions import PluginScorer
from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.chat_turns import ChatTurns
from colossal_rl.rollout.multi_turn import MultiTurnLimits, collate, run_episodes, turn_metrics

ROW = {"messages": {"role": "user", "content": "6*7=?"}, "gt_answer": "42"}
SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=200)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatTurns(tokenizer)


class ScriptedBackend:
    """Replies ``script[call][row]`` (text, then EOS unless it ends with ``...``); log-probs -0.01 * position."""

    def __init__(self, tokenizer, script: list[list[str]]):
        self.tokenizer, self.script, self.calls, self.histories = tokenizer, script, 0, []

    def generate(self, prompts, num_samples, sampling, vision=None, images=None) -> GenerationOutput:
        assert num_samples == 1
        self.histories.append([list(p) for p in prompts])
        replies = [self._ids(text) for text in self.script[self.calls]]
        self.calls += 1
        cut = [ids[: sampling.max_new_tokens] for ids in replies]
        width = max(len(ids) for ids in cut)
        ids = torch.full((len(cut), width), self.tokenizer.pad_token_id)
        mask = torch.zeros((len(cut), width), dtype=torch.long)
        for row, tokens in enumerate(cut):
            ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
        logprobs = -0.01 * torch.arange(1, width + 1).float().expand(len(cut), width) * mask
        eos = self.tokenizer.eos_token_id
        truncated = torch.tensor([not tokens or tokens[-1] != eos for tokens in cut])
        return GenerationOutput(
            prompt_ids=torch.zeros(len(cut), 1, dtype=torch.long),
            prompt_mask=torch.ones(len(cut), 1, dtype=torch.long),
            response_ids=ids,
            response_mask=mask,
            behaviour_logprobs=logprobs,
            truncated=truncated,
            responses=[],
        )

    def _ids(self, text: str) -> list[int]:
        if text.endswith("..."):
            return self.tokenizer.encode(text[:-3], add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]


def context() -> EnvironmentContext:
    exact = PluginScorer(lambda response, row: float(response.strip() == row["gt_answer"]), "exact")
    return EnvironmentContext(reward_scorer=exact, system_prompt="Use the tools.")


LIMITS = MultiTurnLimits(max_turns=4, max_total_tokens=400)


def calculator_episodes(tokenizer, chat, script, limits=LIMITS, rows=1):
    backend = ScriptedBackend(tokenizer, script)
    environments = [environment_factory("calculator")(context()) for _ in range(rows)]
    return run_episodes(backend, chat, environments, [ROW] * rows, SAMPLING, limits), backend


def test_two_turn_episode_tokens_and_masks_are_exact(tokenizer, chat):
    (episode,), backend = calculator_episodes(tokenizer, chat, [[CALL], ["42"]])
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tokenizer.eos_token_id]
    turn1, observation, turn2 = (
        encode(CALL) + eos,
        encode("<|user|><tool_response>\n42\n</tool_response><|assistant|>"),
        encode("42") + eos,
    )
    assert episode.response_ids == turn1 + observation + turn2
    assert episode.policy_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    expected_logprobs = [-0.01 * (i + 1) for i in range(len(turn1))] + [0.0] * len(observation)
    expected_logprobs += [-0.01 * (i + 1) for i in range(len(turn2))]
    assert episode.behaviour_logprobs == pytest.approx(expected_logprobs)
    assert (episode.reward, episode.answer_ok, episode.end, episode.status) == (1.0, True, "done", "ok")
    assert [t.tool_calls for t in episode.turns] == [1, 0] and episode.turn_texts == (CALL, "42")
    # the second turn was generated from the full history, sampled ids untouched
    assert backend.histories[1] == [episode.prompt_ids + turn1 + observation]
    # the whole sequence is what the chat template renders for the finished conversation
    conversation = chat_messages_with_tools(chat) + [
        {"role": "assistant", "content": CALL},
        {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
        {"role": "assistant", "content": "42"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(episode.prompt_ids + episode.response_ids) == rendered


def chat_messages_with_tools(chat):
    from colossal_rl.environments.calculator import CALCULATOR
    from colossal_rl.rollout.chat_turns import with_tools_in_system

    return with_tools_in_system([{"role": "system", "content": "Use the tools."}, ROW["messages"]], [CALCULATOR])


def test_collate_pads_and_keeps_masks(tokenizer, chat):
    episodes, _ = calculator_episodes(tokenizer, chat, [[CALL, "41"], ["42"]], rows=2)
    output = collate(episodes, tokenizer.pad_token_id)
    long, short = episodes
    assert output.response_ids.shape == (2, len(long.response_ids))
    assert output.policy_mask[0].tolist() == long.policy_mask
    assert output.response_mask[1].tolist() == [1] * len(short.response_ids) + [0] * (
        len(long.response_ids) - len(short.response_ids)
    )
    assert output.rewards.tolist() == [1.0, 0.0] and output.truncated.tolist() == [False, False]
    assert bool((output.behaviour_logprobs[output.policy_mask == 0] == 0).all())
    metrics = turn_metrics(episodes)
    assert metrics["rollout/turns"] == 1.5 and metrics["rollout/tool_calls"] == 0.5
    assert metrics["rollout/tool_call_rate"] == 0.5  # one of the two episodes called the calculator


def test_malformed_call_is_an_observation_and_the_episode_goes_on(tokenizer, chat):
    script = [['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"</tool_call>'], ["42"]]
    (episode,), _ = calculator_episodes(tokenizer, chat, script)
    observation = [t for t, m in zip(episode.response_ids, episode.policy_mask, strict=True) if m == 0]
    assert "<tool_response>\nerror: invalid JSON" in tokenizer.decode(observation)
    assert episode.turns[0].tool_errors == 1 and episode.end == "done" and episode.reward == 1.0


def test_turn_limit_ends_the_episode_without_a_reward(tokenizer, chat):
    limits = MultiTurnLimits(max_turns=2, max_total_tokens=400)
    (episode,), backend = calculator_episodes(tokenizer, chat, [[CALL], [CALL], ["42"]], limits)
    assert backend.calls == 2 and len(episode.turns) == 2
    assert (episode.end, episode.reward, episode.status) == ("max_turns", 0.0, "no_reward")
    assert episode.policy_mask[-1] == 1 and episode.turns[-1].observation_tokens == 0  # no dangling observation


@pytest.mark.parametrize(
    ("second_turn", "room", "end", "reward"),
    [("4242424242", 3, "done", 0.0), (CALL, 15, "max_tokens", 0.0)],
    ids=["answer_cut_then_scored", "call_cut_then_no_room"],
)
def test_token_budget_cuts_the_turn_that_would_exceed_it(tokenizer, chat, second_turn, room, end, reward):
    observation = "<|user|><tool_response>\n42\n</tool_response><|assistant|>"
    first = len(tokenizer.encode(CALL)) + 1 + len(tokenizer.encode(observation))
    limits = MultiTurnLimits(max_turns=4, max_total_tokens=first + room)
    (episode,), backend = calculator_episodes(tokenizer, chat, [[CALL], [second_turn], ["42"]], limits)
    assert len(episode.response_ids) == first + room and (episode.end, episode.reward) == (end, reward)
    assert backend.calls == 2 and episode.turns[-1].truncated and episode.turns[-1].generated_tokens == room
    assert collate([episode], tokenizer.pad_token_id).truncated.tolist() == [True]


def test_an_observation_leaving_no_room_ends_the_episode(tokenizer, chat):
    limits = MultiTurnLimits(max_turns=4, max_total_tokens=len(tokenizer.encode(CALL)) + 5)
    (episode,), backend = calculator_episodes(tokenizer, chat, [[CALL], ["42"]], limits)
    assert backend.calls == 1 and episode.end == "max_tokens" and all(episode.policy_mask)


class Raising:
    def reset(self, row):
        return [row["messages"]]

    def step(self, text):
        raise RuntimeError("plug-in bug")


def test_an_environment_that_raises_ends_only_its_episode(tokenizer, chat):
    environments = [Raising(), environment_factory("calculator")(context())]
    backend = ScriptedBackend(tokenizer, [["x", CALL], ["42"]])
    broken, fine = run_episodes(backend, chat, environments, [ROW, ROW], SAMPLING, MultiTurnLimits())
    assert (broken.end, broken.status, broken.reward) == ("environment_error", "infra_error", 0.0)
    assert broken.environment_error == "Raising.step raised RuntimeError: plug-in bug" and fine.environment_error == ""
    assert (fine.end, fine.reward) == ("done", 1.0) and len(backend.histories[1]) == 1


class RaisingOnReset(Raising):
    def reset(self, row):
        raise KeyError("no such task")


def test_an_environment_raising_on_reset_ends_only_its_episode_before_its_first_turn(tokenizer, chat):
    environments = [RaisingOnReset(), environment_factory("calculator")(context())]
    backend = ScriptedBackend(tokenizer, [["42"]])
    broken, fine = run_episodes(backend, chat, environments, [ROW, ROW], SAMPLING, MultiTurnLimits())
    assert (broken.end, broken.status, broken.reward, broken.response_ids) == ("environment_error", "infra_error",
                                                                              0.0, [])  # fmt: skip
    assert broken.environment_error == "RaisingOnReset.reset raised KeyError: 'no such task'"
    assert "6*7=?" in tokenizer.decode(broken.prompt_ids)  # its prompt: the row's own messages
    assert (fine.end, fine.reward) == ("done", 1.0)
    batch = collate([broken, fine], tokenizer.pad_token_id)
    assert batch.response_mask[0].sum() == 0 and batch.response_mask[1].sum() > 0
    assert turn_metrics([broken, fine])["rollout/env_errors"] == 1.0


QWEN_LIKE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_a_tool_role_renders_the_observation_itself(tokenizer):
    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN_LIKE
    chat = ChatTurns(qwen)
    assert chat.tool_role and not chat.template_tools
    results = [{"role": "tool", "name": "calculator", "content": "42"}, {"role": "tool", "name": "c", "content": "1"}]
    # the turn ended at a stop string (no end-of-turn token sampled): the template's end of turn comes first
    text = chat.observation_text(results, tokenizer.encode(">", add_special_tokens=False)[-1])
    assert text.startswith("<|im_end|>") and text.count("<tool_response>") == 2
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": CALL}, *results]
    prompt = qwen.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert prompt + CALL + text == qwen.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert json.loads(CALL[len("<tool_call>") : -len("</tool_call>")])["name"] == "calculator"


FLAKY = """
from colossal_rl.environments import StepResult


class Flaky:
    steps = 0
    closes = 0

    def __init__(self, context):
        pass

    def reset(self, row):
        return [row["messages"]]

    def step(self, text):
        Flaky.steps += 1
        if Flaky.steps % 3 == 0:
            raise RuntimeError(f"flaky step {Flaky.steps}")
        return StepResult(reward=1.0, done=True)

    def close(self):
        Flaky.closes += 1
        if Flaky.closes == 2:
            raise ValueError("flaky close")
"""


def test_environment_errors_are_counted_and_logged_once_per_rollout_batch(tokenizer, tmp_path, caplog):
    from colossal_rl.config import EnvironmentConfig, GenerationConfig, RLConfig
    from colossal_rl.config_resolve import resolve
    from colossal_rl.rollout.environment_rollout import EnvironmentRollouts

    (tmp_path / "flaky_env.py").write_text(FLAKY)
    config = resolve(
        RLConfig(
            generation=GenerationConfig(num_generations=2, microbatch_size=2, max_new_tokens=8),
            environment=EnvironmentConfig(name=f"{tmp_path / 'flaky_env.py'}:Flaky", max_turns=2),
        )
    )
    rollouts = EnvironmentRollouts(config, tokenizer, reward_scorer=None, pad_token_id=tokenizer.pad_token_id)
    backend = ScriptedBackend(tokenizer, [["a"] * 4, ["a"] * 4])  # 4 rows x 2 samples, 2 rows per call
    with caplog.at_level("WARNING", logger="colossal_rl.rollout.multi_turn"):
        episodes = rollouts.run(backend, [ROW] * 4, 2, SAMPLING).episodes
    errors = [episode.environment_error for episode in episodes]
    assert errors == [
        "",
        "Flaky.close raised ValueError: flaky close",
        "Flaky.step raised RuntimeError: flaky step 3",
        "",
        "",
        "Flaky.step raised RuntimeError: flaky step 6",
        "",
        "",
    ]
    assert [e.status for e in episodes].count("infra_error") == 2  # a close error leaves the reward standing
    assert turn_metrics(episodes)["rollout/env_errors"] == 3.0
    lines = [r.getMessage() for r in caplog.records if r.name == "colossal_rl.rollout.multi_turn"]
    assert lines == [
        "environment raised in 3 of 8 episodes (counted in rollout/env_errors); "
        "first: Flaky.close raised ValueError: flaky close"
    ]
