"""Routing replay (R3) on a tiny Qwen3-MoE, end to end through the real pieces: the producer's sampling forward
records each token's experts (``rollout/decoding.py``), the batch carries them, and the trainer's forward
(``MicroBatchForward.terms`` in every sequence layout) replays them.

The mismatch is made on purpose and deterministic. In each MoE layer, experts 1, 3 and 5 have router rows copied
from experts 0, 2 and 4: each pair's logits tie exactly, near-tied routes. The trainer's weights are the
producer's with experts 1, 3 and 5's rows scaled by 1 + 1e-6, a weight change that moves nothing else measurably
but breaks every such tie the other way: where a pair is ranked k-th and (k+1)-th, the trainer's router picks the
other expert. Without replay those tokens go through another expert's MLP and their log-probs (and every later
token's) move by far more than 1e-5; with replay they are the producer's (fp32, 1e-5): under norm_topk_prob the
forced experts' gate weights, renormalised among themselves, do not depend on the other experts' logits.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from colossal_rl.batch import RolloutBatch, concat_batches
from colossal_rl.config import ModelConfig, RLConfig, TrainConfig
from colossal_rl.moe.blocks import moe_blocks, moe_routing
from colossal_rl.moe.routing import NOT_RECORDED, choose_experts, differing_choices, load_balance_loss, route_dtype
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.decoding import sample_responses
from colossal_rl.rollout.transformers_backend import recorded_routes, response_mask_until_eos
from colossal_rl.training.micro_batch_forward import MicroBatchForward
from colossal_rl.training.step_loss import StepTotals

VOCAB, PAD, EOS = 48, 0, 1
GROUP = 3
LAYOUTS = ("padded", "packed", "shared_prompt")
TIED_PAIRS = (0, 2, 4)
"""The first of each pair of experts whose router rows are the same (near-tied routes)."""


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=PAD,
        eos_token_id=EOS, initializer_range=0.2,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for block in moe_blocks(model):
            for first in TIED_PAIRS:  # experts 0 and 1, 2 and 3...: tied logits on every token
                block.gate.weight[first + 1] = block.gate.weight[first]
    return model


def flipped(model: Qwen3MoeForCausalLM, scale: float = 1 + 1e-6) -> Qwen3MoeForCausalLM:
    """The same weights with the second router row of each tied pair scaled: every tie now goes the other way."""
    other = tiny_moe()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for block in moe_blocks(other):
            for first in TIED_PAIRS:
                block.gate.weight[first + 1] *= scale
    return other


@pytest.fixture(scope="module")
def producer_model() -> Qwen3MoeForCausalLM:
    return tiny_moe()


@pytest.fixture(scope="module")
def rollout(producer_model) -> RolloutBatch:
    return sample_rollout(producer_model)


def sample_rollout(producer_model) -> RolloutBatch:
    """Two groups of GROUP samples of prompts of different lengths, sampled with their routes recorded."""
    torch.manual_seed(1)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 3], [7, 11, 19, 23, 31, 43]]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    prompt_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=12)
    dtype = route_dtype(8)
    decoded = sample_responses(producer_model, prompt_ids, prompt_mask, GROUP, sampling, eos_token_ids=[EOS],
                               pad_token_id=PAD, route_dtype=dtype)  # fmt: skip
    response_mask, truncated = response_mask_until_eos(decoded.response_ids, [EOS])
    repeated_mask = prompt_mask.repeat_interleave(GROUP, dim=0)
    routes = recorded_routes(SimpleNamespace(prompt_mask=repeated_mask, response_mask=response_mask), decoded, GROUP)
    n = len(prompts) * GROUP
    return RolloutBatch(
        prompt_ids=prompt_ids.repeat_interleave(GROUP, dim=0), prompt_mask=repeated_mask,
        response_ids=decoded.response_ids.masked_fill(~response_mask.bool(), PAD), response_mask=response_mask,
        behaviour_logprobs=decoded.logprobs * response_mask, rewards=torch.zeros(n), answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n), truncated=truncated, group_size=GROUP, policy_version=0, **routes,
    )  # fmt: skip


def trainer_logprobs(model, batch: RolloutBatch, layout: str, *, replay: bool) -> tuple[torch.Tensor, StepTotals]:
    config = RLConfig(model=ModelConfig(routing_replay=replay), train=TrainConfig(sequence_layout=layout))
    forward = MicroBatchForward(config, dtype=torch.float32, pad_token_id=PAD, tp_group=None, vocab_size=VOCAB,
                                max_over_ranks=None)  # fmt: skip
    totals = StepTotals()
    with torch.no_grad():
        logprobs = forward.terms(model, batch, batch.group_size, None, with_entropy=False, totals=totals).logprobs
    return logprobs, totals


def gap(logprobs: torch.Tensor, batch: RolloutBatch) -> float:
    return float(((logprobs - batch.behaviour_logprobs).abs() * batch.response_mask).max())


def test_the_recorded_routes_are_the_sampling_forwards_own_choices(rollout):
    """Prompt routes on every real prompt token, response routes on every response token read back (all but a
    response's last), NOT_RECORDED elsewhere; in range, int8 for 8 experts."""
    assert rollout.prompt_routes.dtype == torch.int8 and rollout.prompt_routes.shape[2:] == (3, 2)
    recorded_prompt = (rollout.prompt_routes >= 0).all(-1).all(-1)
    assert torch.equal(recorded_prompt, rollout.prompt_mask.bool())
    lengths = rollout.response_mask.sum(1)
    recorded_response = (rollout.response_routes >= 0).all(-1).all(-1)
    positions = torch.arange(rollout.response_ids.shape[1])[None, :]
    assert torch.equal(recorded_response, positions < (lengths - 1)[:, None])  # every token but the last
    assert bool((rollout.response_routes[~recorded_response] == NOT_RECORDED).all())


def test_the_recorded_routes_are_what_a_full_forward_at_the_same_weights_chooses(producer_model, rollout):
    """Token by token with a KV cache in the producer, all at once in this forward: the same experts (as sets)
    wherever something was recorded."""
    input_ids, attention_mask = rollout.sequences()
    with torch.no_grad(), moe_routing(producer_model) as session:
        producer_model(input_ids=input_ids, attention_mask=attention_mask)
    own = session.recorded(*input_ids.shape, torch.int8).sort(dim=-1).values
    recorded = torch.cat([rollout.prompt_routes, rollout.response_routes], dim=1).sort(dim=-1).values
    where = (recorded >= 0).all(-1)
    assert int(where.sum()) > 0 and torch.equal(own[where], recorded[where])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_weights_the_trainer_recomputes_the_behaviour_logprobs_with_and_without_replay(
    producer_model, rollout, layout
):
    for replay in (False, True):
        logprobs, totals = trainer_logprobs(producer_model, rollout, layout, replay=replay)
        assert gap(logprobs, rollout) < 1e-5, (layout, replay)
    assert totals.values["train/routed_tokens_replayed"] > 0
    assert totals.values["train/routed_tokens_differing"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flipped_near_ties_move_the_logprobs_without_replay_and_not_with_it(producer_model, rollout, layout):
    trainer_model = flipped(producer_model)
    without, plain = trainer_logprobs(trainer_model, rollout, layout, replay=False)
    assert gap(without, rollout) > 1e-3
    assert "train/routed_tokens_replayed" not in plain.values
    replayed, totals = trainer_logprobs(trainer_model, rollout, layout, replay=True)
    assert gap(replayed, rollout) < 1e-5
    assert totals.values["train/routed_tokens_differing"] > 0  # the trainer's own router disagreed, and lost


def test_replaying_the_response_routes_alone_is_not_enough(producer_model, rollout):
    """Why prompt routes are carried too: a flipped prompt token changes every response token that attends to it."""
    no_prompt_routes = dataclasses.replace(rollout, prompt_routes=torch.full_like(rollout.prompt_routes, NOT_RECORDED))
    logprobs, _ = trainer_logprobs(flipped(producer_model), no_prompt_routes, "padded", replay=True)
    assert gap(logprobs, rollout) > 1e-4


def test_routes_survive_concatenation_with_other_widths(producer_model, rollout):
    """Batches of different prompt/response widths join with routes padded the way their tokens are."""
    first, second = rollout.select_groups([0]), rollout.select_groups([1])
    joined = concat_batches([second, first], PAD)
    trainer_model = flipped(producer_model)
    reordered = rollout.select_groups([1, 0])
    replayed, _ = trainer_logprobs(trainer_model, joined, "packed", replay=True)
    assert gap(replayed[:, : reordered.response_ids.shape[1]], reordered) < 1e-5


def test_choose_experts_forced_and_own():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    own = choose_experts(logits, 2, normalize=True)
    assert own.selected.tolist() == [[0, 1], [3, 2]] and not bool(own.replayed.any())
    forced = choose_experts(logits, 2, normalize=True, forced=torch.tensor([[2, 3], [-1, -1]], dtype=torch.int8))
    assert forced.selected.tolist() == [[2, 3], [3, 2]] and forced.replayed.tolist() == [True, False]
    expected = torch.softmax(torch.tensor([1.0, 0.0]), 0)
    assert torch.allclose(forced.weights[0], expected) and torch.equal(forced.weights[1], own.weights[1])
    assert differing_choices(forced) == (1, 1)
    forced.weights[0, 0].backward()  # a forced expert's weight comes from the live router's logits of the forced pair
    assert abs(float(logits.grad[0, 2])) > 0.1 and abs(float(logits.grad[0, 3])) > 0.1
    assert abs(float(logits.grad[0, 0])) < 1e-6  # renormalised among the forced: the others' logits cancel out


def test_the_routed_forward_is_transformers_own_block_without_replay(producer_model):
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = producer_model(input_ids=ids).logits
        with moe_routing(producer_model) as session:
            got = producer_model(input_ids=ids).logits
    assert torch.equal(expected, got) and session.replayed == 0
    assert all("forward" not in vars(block) for block in moe_blocks(producer_model))  # restored


def test_a_dense_model_has_nothing_to_route():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1))  # fmt: skip
    with pytest.raises(ValueError, match="no mixture-of-experts block"), moe_routing(dense):
        pass


def test_routes_survive_the_wire_and_a_checkpoint(rollout, tmp_path):
    """The rollouts of groups not yet trained keep their routes through Ray's bytes and ``chunks.pt``."""
    from colossal_rl.comm.wire import decode, encode
    from colossal_rl.run_checkpoints.on_disk import CHUNKS_FILE, SavedChunk, load_chunks

    chunk = SavedChunk(payload=encode(rollout), batch_rows=(4, 7), producer_rank=1)
    torch.save({3: dataclasses.asdict(chunk)}, tmp_path / CHUNKS_FILE)
    restored = decode(load_chunks(tmp_path)[3].payload)
    assert torch.equal(restored.prompt_routes, rollout.prompt_routes)
    assert torch.equal(restored.response_routes, rollout.response_routes)
    assert restored.response_routes.dtype == torch.int8


def test_the_balance_loss_is_one_when_experts_share_evenly_and_grows_when_they_collapse():
    even = torch.zeros(8, 4)  # every expert equally likely; top-2 slots spread over all four
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    mask = torch.ones(8, dtype=torch.bool)
    assert float(load_balance_loss([even], [chosen], mask, 4)) == pytest.approx(1.0)
    collapsed = torch.tensor([[4.0, 4.0, 0.0, 0.0]] * 8)
    onto_two = torch.tensor([[0, 1]] * 8)
    assert float(load_balance_loss([collapsed], [onto_two], mask, 4)) > 1.9
    masked = mask.clone()
    masked[4:] = False  # padding rows do not count
    assert float(load_balance_loss([even], [chosen], masked, 4)) == pytest.approx(1.0)


def test_router_aux_loss_coef_adds_the_balance_loss_and_its_gradient_reaches_the_routers(producer_model, rollout):
    config = RLConfig(train=TrainConfig(sequence_layout="packed", router_aux_loss_coef=0.01))
    forward = MicroBatchForward(config, dtype=torch.float32, pad_token_id=PAD, tp_group=None, vocab_size=VOCAB,
                                max_over_ranks=None)  # fmt: skip
    terms = forward.terms(producer_model, rollout, rollout.group_size, None, with_entropy=False)
    assert terms.router_balance is not None and float(terms.router_balance) >= 1.0
    producer_model.zero_grad()
    terms.router_balance.backward()
    gates = [block.gate.weight.grad for block in moe_blocks(producer_model)]
    assert all(grad is not None and float(grad.abs().sum()) > 0 for grad in gates)
    producer_model.zero_grad()
    plain = RLConfig(train=TrainConfig(sequence_layout="packed"))
    forward = MicroBatchForward(plain, dtype=torch.float32, pad_token_id=PAD, tp_group=None, vocab_size=VOCAB,
                                max_over_ranks=None)  # fmt: skip
    assert forward.terms(producer_model, rollout, rollout.group_size, None, with_entropy=False).router_balance is None
