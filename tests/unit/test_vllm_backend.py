"""The vLLM backend up to the engine call, on CPU without vLLM: sampling parameters, prompts, re-batching of
vLLM-shaped outputs into our layout (checked against the transformers backend's own output), backend selection
and the error when vLLM is missing.

The fakes below are shaped like vLLM 0.7.3's ``RequestOutput``/``CompletionOutput``/``Logprob``
(vllm/outputs.py, vllm/sequence.py); they stand for the engine, not for the code under test."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.rollout import backend as backend_module
from colossal_rl.rollout.backend import BackendUnavailableError, SamplingSettings, create_backend
from colossal_rl.rollout.vllm_backend import (
    pad_and_eos_token_ids,
    request_prompts,
    sampled_logprobs,
    sampling_params_kwargs,
    strip_padding,
    to_generation_output,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root

from rl_example import UsageError, build_parser, config_from_args  # noqa: E402

# Field names of vllm.SamplingParams in vLLM 0.7.3 (vllm/sampling_params.py) that we set.
VLLM_073_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "max_tokens", "logprobs",
    "skip_special_tokens", "include_stop_str_in_output",
}  # fmt: skip


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    text: str = ""
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


def completion(index: int, tokens: list[int], logprobs: list[float], finish_reason: str) -> CompletionOutput:
    # vLLM's logprobs=0 dicts hold the sampled token (and, at other ranks, nothing else); add a distractor anyway.
    steps = [
        {99: Logprob(-9.0, rank=2), token: Logprob(lp, rank=1)} for token, lp in zip(tokens, logprobs, strict=True)
    ]
    return CompletionOutput(index=index, token_ids=tokens, logprobs=steps, finish_reason=finish_reason)


def decode(rows: list[list[int]]) -> list[str]:
    return [" ".join(map(str, row)) for row in rows]


# --- sampling parameters -------------------------------------------------------------------------------------


def test_sampling_maps_every_setting():
    settings = SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=64, stop_strings=("</answer>",))
    kwargs = sampling_params_kwargs(settings, 8, stop_token_ids=[2, 0], seed=1234)
    assert kwargs == dict(
        n=8,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        max_tokens=64,
        stop=["</answer>"],
        include_stop_str_in_output=True,
        stop_token_ids=[2, 0],
        logprobs=0,
        seed=1234,
        skip_special_tokens=True,
    )
    assert set(kwargs) <= VLLM_073_SAMPLING_FIELDS


def test_sampling_without_top_k_or_stop_strings():
    kwargs = sampling_params_kwargs(SamplingSettings(temperature=1.0, max_new_tokens=16), 4, stop_token_ids=[0], seed=7)
    assert kwargs["top_k"] == -1  # vLLM's "disabled"
    assert kwargs["stop"] is None
    assert (kwargs["n"], kwargs["top_p"], kwargs["seed"]) == (4, 1.0, 7)


def test_greedy_sampling_is_temperature_zero_one_sample_no_seed():
    greedy = SamplingSettings(temperature=1.0, top_k=5, top_p=0.5, max_new_tokens=8, greedy=True)
    kwargs = sampling_params_kwargs(greedy, 3, stop_token_ids=[0], seed=11)
    assert (kwargs["n"], kwargs["temperature"], kwargs["top_k"], kwargs["top_p"], kwargs["seed"]) == (
        1,
        0.0,
        -1,
        1.0,
        None,
    )
    assert kwargs["logprobs"] == 0


def test_greedy_prompts_are_repeated_sampled_ones_are_not():
    prompts = [[1, 2], [3]]
    assert request_prompts(prompts, 3, greedy=False) == prompts
    assert request_prompts(prompts, 2, greedy=True) == [[1, 2], [1, 2], [3], [3]]
    with pytest.raises(ValueError, match="empty prompt"):
        request_prompts([[1], []], 1, greedy=False)


def test_strip_padding_left_and_right():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [11, 12, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    assert strip_padding(ids, mask) == [[5, 6], [7, 8, 9, 10], [11, 12]]


def test_pad_and_eos_follow_the_cpu_backend_rules():
    class Tokenizer:
        pad_token_id = None
        eos_token_id = 5

    assert pad_and_eos_token_ids(Tokenizer(), [7, 5, None]) == (5, [5, 7])
    assert pad_and_eos_token_ids(Tokenizer(), None) == (5, [5])


# --- re-batching vLLM outputs ----------------------------------------------------------------------------------


def test_rebatching_pads_orders_and_flags():
    outputs = [
        RequestOutput(
            "0",
            [11, 12, 13],
            # completions out of index order: rows must follow .index
            [completion(1, [21, 0], [-0.5, -0.25], "stop"), completion(0, [20, 22, 23], [-1.0, -2.0, -3.0], "length")],
        ),
        RequestOutput(
            "1", [14], [completion(0, [24], [-0.125], "stop"), completion(1, [25, 26], [-1.5, -0.75], "stop")]
        ),
    ]
    out = to_generation_output(outputs, num_samples=2, pad_token_id=0, decode=decode)
    torch.testing.assert_close(out.prompt_ids, torch.tensor([[11, 12, 13]] * 2 + [[0, 0, 14]] * 2))
    torch.testing.assert_close(out.prompt_mask, torch.tensor([[1, 1, 1]] * 2 + [[0, 0, 1]] * 2))
    torch.testing.assert_close(out.response_ids, torch.tensor([[20, 22, 23], [21, 0, 0], [24, 0, 0], [25, 26, 0]]))
    torch.testing.assert_close(out.response_mask, torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]]))
    torch.testing.assert_close(
        out.behaviour_logprobs,
        torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0], [-0.125, 0.0, 0.0], [-1.5, -0.75, 0.0]]),
    )
    assert out.behaviour_logprobs.dtype == torch.float32
    assert out.truncated.tolist() == [True, False, False, False]
    assert out.responses == ["20 22 23", "21 0", "24", "25 26"]


def test_rebatching_greedy_requests_with_one_completion_each():
    outputs = [RequestOutput(str(i), [1, 2], [completion(0, [3, 0], [-0.1, -0.2], "stop")]) for i in range(2)]
    out = to_generation_output(outputs, num_samples=2, pad_token_id=0, decode=decode)
    assert out.response_ids.shape == (2, 2) and out.truncated.tolist() == [False, False]


def test_rebatching_refuses_missing_logprobs_and_wrong_counts():
    no_logprobs = [RequestOutput("0", [1], [CompletionOutput(0, [2], None, "stop")])]
    with pytest.raises(ValueError, match="logprobs must be 0"):
        to_generation_output(no_logprobs, num_samples=1, pad_token_id=0, decode=decode)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        outputs = [RequestOutput("0", [1], [completion(0, [2], [-1.0], "stop")])]
        to_generation_output(outputs, num_samples=2, pad_token_id=0, decode=decode)
    with pytest.raises(ValueError, match="2 log-prob entries for 1 tokens"):
        sampled_logprobs([2], [{2: Logprob(-1.0)}, {3: Logprob(-1.0)}])


def test_rebatching_reproduces_the_transformers_backend_layout():
    """Feed the CPU backend's own samples through vLLM-shaped outputs: the re-batched tensors must be identical."""
    from colossal_rl.rollout.transformers_backend import TransformersBackend

    cpu = TransformersBackend(str(EMBEDDED_MODEL_DIR))
    prompts = [cpu.tokenizer.encode("12+3="), cpu.tokenizer.encode("4+5+678=")]
    torch.manual_seed(0)
    expected = cpu.generate(prompts, 3, SamplingSettings(temperature=1.0, max_new_tokens=6))
    requests = []
    for p, prompt in enumerate(prompts):
        completions = []
        for s in range(3):
            row = p * 3 + s
            length = int(expected.response_mask[row].sum())
            tokens = expected.response_ids[row, :length].tolist()
            logprobs = expected.behaviour_logprobs[row, :length].tolist()
            completions.append(completion(s, tokens, logprobs, "length" if expected.truncated[row] else "stop"))
        requests.append(RequestOutput(str(p), prompt, completions))
    decode_cpu = lambda rows: cpu.tokenizer.batch_decode(rows, skip_special_tokens=True)  # noqa: E731
    out = to_generation_output(requests, num_samples=3, pad_token_id=cpu.pad_token_id, decode=decode_cpu)
    for name in ("prompt_ids", "prompt_mask", "response_mask", "behaviour_logprobs", "truncated"):
        got, want = getattr(out, name), getattr(expected, name)
        torch.testing.assert_close(got, want[:, : got.shape[1]] if got.dim() == 2 else want, msg=name)
    width = out.response_ids.shape[1]
    assert not expected.response_mask[:, width:].any()  # nothing real was cut off
    torch.testing.assert_close(out.response_ids, expected.response_ids[:, :width])
    assert out.responses == expected.responses


# --- backend selection -----------------------------------------------------------------------------------------


def test_vllm_is_not_installed_here():
    assert not backend_module.vllm_installed()


def test_create_backend_without_vllm_says_what_to_install():
    with pytest.raises(BackendUnavailableError, match=r'pip install -e "\.\[gpu\]"'):
        create_backend("vllm", str(EMBEDDED_MODEL_DIR))


def test_create_backend_picks_vllm_when_installed(monkeypatch):
    created = {}

    class FakeVllmBackend:
        def __init__(self, model_path, *, tensor_parallel_size, seed):
            created.update(model_path=model_path, tensor_parallel_size=tensor_parallel_size, seed=seed)

    import colossal_rl.rollout.vllm_backend as vllm_backend

    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_backend, "VllmBackend", FakeVllmBackend)
    assert isinstance(create_backend("vllm", "some/model", tensor_parallel_size=2, seed=3), FakeVllmBackend)
    assert created == {"model_path": "some/model", "tensor_parallel_size": 2, "seed": 3}


def test_create_backend_refuses_unknown_names_and_tensor_parallel_transformers():
    with pytest.raises(ValueError, match="unknown inference backend"):
        create_backend("tgi", "m")
    with pytest.raises(ValueError, match="needs the vllm backend"):
        create_backend("transformers", str(EMBEDDED_MODEL_DIR), tensor_parallel_size=2)


def test_vllm_backend_module_imports_without_vllm():
    assert "vllm" not in sys.modules


# --- the command line ------------------------------------------------------------------------------------------


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_cli_vllm_without_vllm_is_one_clear_error():
    with pytest.raises(UsageError) as caught:
        parse("-b", "vllm")
    assert str(caught.value) == backend_module.VLLM_MISSING
    assert 'pip install -e ".[gpu]"' in str(caught.value)


def test_cli_accepts_vllm_and_producer_tensor_parallelism_when_vllm_is_installed(monkeypatch):
    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    config = parse("-b", "vllm", "-ptp", "2")
    assert (config.generation.backend, config.generation.tensor_parallel_size) == ("vllm", 2)


def test_cli_producer_tensor_parallelism_needs_vllm():
    with pytest.raises(UsageError, match="-ptp/--producer-tensor-parallel-size > 1 needs -b vllm"):
        parse("-ptp", "2")
