"""``scripts/widen_model.py``: the embedded model grown wider and deeper computes the same function (its greedy
answers included), has the new size, and its new parts are trainable (not all zero), so a benchmark on it costs
what a model of that size costs and still does the embedded task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from colossal_rl.config import EMBEDDED_MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from widen_model import widened_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_the_widened_model_answers_as_the_embedded_one_with_more_parameters(tmp_path):
    out = tmp_path / "wide"
    subprocess.run([sys.executable, str(REPO / "scripts" / "widen_model.py"), "--out", str(out),
                    "--intermediate-size", "512", "--layers", "6"], check=True, timeout=300)  # fmt: skip
    source = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32)
    wide = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert (wide.config.intermediate_size, wide.config.num_hidden_layers) == (512, 6)
    assert sum(p.numel() for p in wide.parameters()) > 1.4 * sum(p.numel() for p in source.parameters())
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = source.generate(ids, max_new_tokens=12, do_sample=False)
        got = wide.generate(ids, max_new_tokens=12, do_sample=False)
        torch.testing.assert_close(wide(input_ids=got).logits, source(input_ids=got).logits, atol=1e-5, rtol=0)
    assert torch.equal(got, expected)


def test_new_units_and_layers_add_nothing_yet_are_not_all_zero():
    source = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32)
    config = source.config.to_dict() | {"intermediate_size": 400, "num_hidden_layers": 5}
    target = AutoModelForCausalLM.from_config(type(source.config).from_dict(config), torch_dtype=torch.float32)
    state = widened_state(source, target, seed=0)
    width = source.config.intermediate_size
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"][:, width:], torch.zeros(128, 400 - width))
    assert state["model.layers.0.mlp.gate_proj.weight"][width:].abs().sum() > 0
    assert torch.equal(
        state["model.layers.0.mlp.up_proj.weight"][:width], source.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )
    new_layer = "model.layers.4."
    assert (
        not state[new_layer + "self_attn.o_proj.weight"].any() and not state[new_layer + "mlp.down_proj.weight"].any()
    )
    assert state[new_layer + "self_attn.q_proj.weight"].abs().sum() > 0
