"""``--sequence-layout auto`` chooses each micro-batch's block layout from its shape (``training/layout_choice.py``):
the cost estimate's pieces, the choice at short and long responses (the measured crossover: shared_prompt at 16
tokens, packed at 128 on the 1 M model), and a trainer's forward that takes it, with the same log-probs either way."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import EMBEDDED_MODEL_DIR, RLConfig, TrainConfig
from colossal_rl.training.layout_choice import cheaper_block_layout, forward_cost, pair_weight
from colossal_rl.training.micro_batch_forward import MicroBatchForward
from colossal_rl.training.sequence_layout import Block
from colossal_rl.training.step_loss import StepTotals

GROUP, PAD, VOCAB = 8, 0, 64


def test_a_pair_costs_the_query_width_over_the_linear_layers_of_a_position():
    config = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)  # hidden 128, 4 heads of 32, 2 kv heads, MLP 384
    linear = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384
    assert pair_weight(config) == pytest.approx(2 * 128 / linear)
    moe = Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=999)
    moe.num_experts_per_tok, moe.moe_intermediate_size = 2, 32  # only the experts a token runs through count
    assert pair_weight(moe) == pytest.approx(2 * 64 / (4 * 64 * 64 + 3 * 64 * 32 * 2))


def test_rows_cost_their_positions_and_pairs_padded_to_the_widest():
    rows = [[Block((0,), 3, (2,)), Block((1,), 1, (1,))], [Block((2,), 4, (1,))]]  # widths 7 and 5: both 7
    assert forward_cost(rows, 0.5) == 2 * (7 + 0.5 * 49)
    assert forward_cost([], 0.5) == 0.0


@pytest.mark.parametrize(("response", "chosen"), [(16, "shared_prompt"), (128, "packed")])
def test_the_embedded_models_shape_shares_prompts_at_short_responses_and_packs_long_ones(response, chosen):
    weight = pair_weight(AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR))
    assert cheaper_block_layout([85] * 2 * GROUP, [response] * 2 * GROUP, GROUP, weight) == chosen
    assert cheaper_block_layout([85] * 2 * GROUP, [response] * 2 * GROUP, GROUP, 0.0) == "shared_prompt"


def long_batch() -> RolloutBatch:
    torch.manual_seed(0)
    n, prompt, response = 2 * GROUP, 6, 40
    prompts = torch.randint(1, VOCAB, (2, prompt)).repeat_interleave(GROUP, dim=0)
    lengths = torch.randint(20, response + 1, (n,))
    response_mask = (torch.arange(response)[None, :] < lengths[:, None]).long()
    return RolloutBatch(
        prompt_ids=prompts, prompt_mask=torch.ones_like(prompts),
        response_ids=torch.randint(1, VOCAB, (n, response)) * response_mask, response_mask=response_mask,
        behaviour_logprobs=torch.zeros(n, response), rewards=torch.zeros(n), answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n), truncated=torch.zeros(n, dtype=torch.bool), group_size=GROUP, policy_version=0,
    )  # fmt: skip


def test_auto_lays_a_long_response_micro_batch_out_packed_with_shared_prompts_log_probs():
    """A model where pairs are dear (hidden 32, MLP 32): 8 x 40-token responses per group are cheaper packed."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()  # fmt: skip
    batch = long_batch()
    results = {}
    for layout in ("auto", "shared_prompt", "packed"):
        forward = MicroBatchForward(RLConfig(train=TrainConfig(sequence_layout=layout)), dtype=torch.float32,
                                    pad_token_id=PAD, tp_group=None, vocab_size=VOCAB, max_over_ranks=None)  # fmt: skip
        with torch.no_grad():
            terms = forward.terms(model, batch, GROUP, None, with_entropy=False, totals=StepTotals())
        results[layout] = (forward, terms)
    auto, _ = results["auto"]
    assert auto.by_shape and auto.layout == "shared_prompt"
    assert auto.layout_name(batch, GROUP) == "packed"
    assert results["auto"][1].layout.computed_tokens == results["packed"][1].layout.computed_tokens
    assert results["auto"][1].layout.computed_tokens != results["shared_prompt"][1].layout.computed_tokens
    torch.testing.assert_close(results["auto"][1].logprobs, results["shared_prompt"][1].logprobs, atol=1e-5, rtol=0)
    assert not results["shared_prompt"][0].by_shape  # a layout asked for by name is kept


def test_auto_keeps_shared_prompt_under_a_token_budget_it_was_planned_by():
    """``--max-tokens-per-microbatch`` plans micro-batches by what shared_prompt computes: packed could exceed it."""
    config = RLConfig(train=TrainConfig(sequence_layout="auto", max_tokens_per_microbatch=4096))
    forward = MicroBatchForward(config, dtype=torch.float32, pad_token_id=PAD, tp_group=None, vocab_size=VOCAB,
                                max_over_ranks=None)  # fmt: skip
    assert forward.layout == "shared_prompt" and not forward.by_shape


def test_a_sliding_window_model_trains_padded_and_an_asked_block_layout_is_refused():
    """Block masks of packed and shared-prompt rows attend past a sliding window: measured on the tiny OLMo 3 (window
    64, prompts ~80 tokens), trainer and vLLM log-probs 0.68-0.90 apart in shared_prompt, equal in padded."""
    from colossal_rl.training.micro_batch_forward import SLIDING_WINDOW_LAYOUT, attends_in_sliding_window

    config = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    assert not attends_in_sliding_window(config)  # Qwen2: sliding_window set but use_sliding_window off
    config.use_sliding_window, config.sliding_window = True, 64
    assert attends_in_sliding_window(config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    assert not attends_in_sliding_window(config)  # no layer uses it

    def forward(layout: str) -> MicroBatchForward:
        run = RLConfig(train=TrainConfig(sequence_layout=layout))
        return MicroBatchForward(run, dtype=torch.float32, pad_token_id=0, tp_group=None, vocab_size=10,
                                 max_over_ranks=None, sliding_window=True)  # fmt: skip

    assert forward("auto").layout == "padded" and not forward("auto").by_shape
    with pytest.raises(ValueError, match=SLIDING_WINDOW_LAYOUT.format(layout="packed").split(":")[0]):
        forward("packed")


def test_a_config_without_a_use_sliding_window_flag_attends_in_its_window():
    """OLMo 3's config (the embedded tiny one, written by transformers 5) has ``sliding_window`` and ``layer_types``
    but no ``use_sliding_window``: its window is on, and it must train padded. Read as a plain config (transformers
    4.51.3 does not know ``olmo3``)."""
    import json

    from transformers import PretrainedConfig

    from colossal_rl.config import ASSETS_DIR
    from colossal_rl.training.micro_batch_forward import attends_in_sliding_window

    olmo3 = json.loads((ASSETS_DIR / "tiny_olmo3" / "config.json").read_text())
    assert "use_sliding_window" not in olmo3 and "sliding_attention" in olmo3["layer_types"]
    assert attends_in_sliding_window(PretrainedConfig.from_dict(olmo3))
    no_window = olmo3 | {"sliding_window": None}
    assert not attends_in_sliding_window(PretrainedConfig.from_dict(no_window))
