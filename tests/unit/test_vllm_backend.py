"""The vLLM backend up to the engine call, on CPU without vLLM: sampling parameters, prompts, re-batching of
vLLM-shaped outputs into our layout (checked against the transformers backend's own output), backend selection
and the error when vLLM is missing; image prompts of a vision-language model (collapsed placeholders, raw images,
our expanded prompt ids in the rows), and the whole ``VllmBackend`` driven through a fake ``vllm`` module.

The fakes below are shaped like vLLM 0.7.3's ``RequestOutput``/``CompletionOutput``/``Logprob``
(vllm/outputs.py, vllm/sequence.py) and mimic its multimodal placeholder replacement (``vllm_073_expand``); they
stand for the engine, not for the code under test. ``tests/contract`` runs the real processor."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from vision_fixtures import build_random_vlm, draw_shapes

from colossal_rl.config import EMBEDDED_MODEL_DIR, GenerationConfig, VllmEngineConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.data import ImagePrompting, load_prompt_dataset
from colossal_rl.rollout import backend as backend_module
from colossal_rl.rollout.backend import (
    BackendUnavailableError,
    SamplingSettings,
    eval_sampling,
    train_sampling,
)
from colossal_rl.rollout.backend_factory import create_backend
from colossal_rl.rollout.vllm_backend import (
    DEFAULT_IMAGES_PER_PROMPT,
    engine_kwargs,
    max_model_len,
    pad_and_eos_token_ids,
)
from colossal_rl.rollout.vllm_requests import (
    collapse_image_pads,
    image_requests,
    image_token_counts,
    request_prompts,
    sampled_logprobs,
    sampling_params_kwargs,
    to_generation_output,
    vllm_requests,
)
from colossal_rl.vision.inputs import VisionInputs

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root

from rl_example import UsageError, build_parser, config_from_args  # noqa: E402

without_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: this checks the behaviour without it"
)

# Field names of vllm.SamplingParams that we set (tests/vllm_engine checks them against the installed vLLM's).
VLLM_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "max_tokens", "logprobs",
    "skip_special_tokens", "include_stop_str_in_output",
}  # fmt: skip

# EngineArgs fields that vllm.LLM accepts and we set (tests/vllm_engine checks them against the installed vLLM's).
VLLM_LLM_ARGUMENTS = {
    "model", "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization", "enforce_eager",
    "distributed_executor_backend", "enable_chunked_prefill", "max_model_len", "enable_prefix_caching",
    "trust_remote_code", "limit_mm_per_prompt", "mm_processor_kwargs", "logprobs_mode", "worker_extension_cls",
    "block_size",
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
    assert set(kwargs) <= VLLM_SAMPLING_FIELDS


def test_sampling_without_top_k_or_stop_strings():
    kwargs = sampling_params_kwargs(SamplingSettings(temperature=1.0, max_new_tokens=16), 4, stop_token_ids=[0], seed=7)
    assert kwargs["top_k"] == 0  # vLLM's "disabled"
    assert kwargs["stop"] is None
    assert (kwargs["n"], kwargs["top_p"], kwargs["seed"]) == (4, 1.0, 7)


def test_greedy_sampling_is_temperature_zero_one_sample_no_seed():
    greedy = SamplingSettings(temperature=1.0, top_k=5, top_p=0.5, max_new_tokens=8, greedy=True)
    kwargs = sampling_params_kwargs(greedy, 3, stop_token_ids=[0], seed=11)
    assert (kwargs["n"], kwargs["temperature"], kwargs["top_k"], kwargs["top_p"], kwargs["seed"]) == (
        1,
        0.0,
        0,
        1.0,
        None,
    )
    assert kwargs["logprobs"] == 0


def test_generation_config_to_vllm_sampling_for_training_and_evaluation():
    gen = GenerationConfig(
        num_generations=6, temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=32, stop_strings=("</answer>",)
    )
    train = sampling_params_kwargs(train_sampling(gen), gen.num_generations, stop_token_ids=[0], seed=5)
    assert (train["n"], train["temperature"], train["top_k"], train["top_p"]) == (6, 0.8, 40, 0.95)
    assert (train["max_tokens"], train["stop"], train["include_stop_str_in_output"]) == (32, ["</answer>"], True)
    assert train["logprobs"] == 0  # the sampled token's log-prob only

    greedy_eval = sampling_params_kwargs(eval_sampling(gen), 1, stop_token_ids=[0], seed=5)
    assert (greedy_eval["n"], greedy_eval["temperature"], greedy_eval["top_k"], greedy_eval["top_p"]) == (
        1,
        0.0,
        0,
        1.0,
    )
    assert (greedy_eval["max_tokens"], greedy_eval["stop"]) == (32, ["</answer>"])

    sampled_gen = GenerationConfig(temperature=0.8, top_k=40, top_p=0.95, eval_temperature=0.6, stop_strings=())
    sampled_eval = sampling_params_kwargs(eval_sampling(sampled_gen), 1, stop_token_ids=[0], seed=5)
    assert (sampled_eval["n"], sampled_eval["temperature"], sampled_eval["top_k"], sampled_eval["top_p"]) == (
        1,
        0.6,
        40,
        0.95,
    )


# --- engine arguments ------------------------------------------------------------------------------------------


def test_engine_arguments_come_from_the_config_and_are_vllm_arguments():
    engine = VllmEngineConfig(gpu_memory_utilization=0.5, enforce_eager=False, enable_chunked_prefill=False)
    kwargs = engine_kwargs("/models/qwen", engine, tensor_parallel_size=2, seed=3, max_len=4096)
    assert set(kwargs) <= VLLM_LLM_ARGUMENTS
    assert kwargs["model"] == "/models/qwen"
    assert (kwargs["gpu_memory_utilization"], kwargs["enforce_eager"], kwargs["enable_chunked_prefill"]) == (
        0.5,
        False,
        False,
    )
    assert (kwargs["tensor_parallel_size"], kwargs["seed"], kwargs["max_model_len"]) == (2, 3, 4096)
    assert kwargs["distributed_executor_backend"] == "mp"  # not Ray's executor inside a Ray actor
    assert kwargs["enable_prefix_caching"] is True  # reset after every weight load
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # the sampled-from distribution, at the temperature
    assert kwargs["worker_extension_cls"] == "colossal_rl.rollout.vllm_worker.WeightLoaderExtension"
    assert kwargs["trust_remote_code"] is False  # the model's own code runs only when asked
    trusted = engine_kwargs("m", engine, tensor_parallel_size=1, seed=0, max_len=None, trust_remote_code=True)
    assert trusted["trust_remote_code"] is True
    one_gpu = engine_kwargs("m", VllmEngineConfig(), tensor_parallel_size=1, seed=0, max_len=None)
    assert one_gpu["distributed_executor_backend"] is None
    assert one_gpu["block_size"] is None  # vLLM's platform default
    assert engine_kwargs("m", VllmEngineConfig(block_size=32), tensor_parallel_size=1, seed=0,
                         max_len=None)["block_size"] == 32  # fmt: skip
    assert (one_gpu["gpu_memory_utilization"], one_gpu["enforce_eager"], one_gpu["enable_chunked_prefill"]) == (
        0.7,
        True,
        True,
    )


def test_chunked_prefill_is_off_on_cpu_where_seeded_requests_would_kill_the_engine():
    engine = VllmEngineConfig(enable_chunked_prefill=True)
    assert engine_kwargs("m", engine, tensor_parallel_size=1, seed=0, max_len=None)["enable_chunked_prefill"] is True
    on_cpu = engine_kwargs("m", engine, tensor_parallel_size=1, seed=0, max_len=None, on_cpu=True)
    assert on_cpu["enable_chunked_prefill"] is False


def test_engine_arguments_of_a_vision_language_model():
    engine = VllmEngineConfig()  # chunked prefill on
    kwargs = engine_kwargs(
        "vlm", engine, tensor_parallel_size=1, seed=0, max_len=2048, vision_language=True, images_per_prompt=3,
        min_pixels=3136, max_pixels=12544,
    )  # fmt: skip
    assert set(kwargs) <= VLLM_LLM_ARGUMENTS
    assert kwargs["limit_mm_per_prompt"] == {"image": 3, "video": 0}  # no videos: none reserved or profiled
    assert kwargs["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 12544}  # resized like our processor
    assert kwargs["enable_chunked_prefill"] is True  # V1 chunks a prompt's images fine
    defaults = engine_kwargs("vlm", engine, tensor_parallel_size=1, seed=0, max_len=None, vision_language=True)
    assert (
        defaults["limit_mm_per_prompt"] == {"image": DEFAULT_IMAGES_PER_PROMPT, "video": 0} == {"image": 1, "video": 0}
    )
    assert "mm_processor_kwargs" not in defaults  # the checkpoint's own processor settings
    only_max = engine_kwargs("vlm", engine, tensor_parallel_size=1, seed=0, max_len=None, vision_language=True,
                             max_pixels=50176)  # fmt: skip
    assert only_max["mm_processor_kwargs"] == {"max_pixels": 50176}
    # vLLM refuses limit_mm_per_prompt for a text model: a text model gets neither key.
    text = engine_kwargs("m", engine, tensor_parallel_size=1, seed=0, max_len=None, images_per_prompt=3, max_pixels=9)
    assert "limit_mm_per_prompt" not in text and "mm_processor_kwargs" not in text
    assert text["enable_chunked_prefill"] is True


def test_max_model_len_is_configured_or_prompt_plus_response_capped_by_the_model():
    assert max_model_len(8192, 4096, 32768) == 8192
    assert max_model_len(None, 512 + 3584, 32768) == 4096
    assert max_model_len(None, 512 + 16, 256) == 256  # the embedded model's context
    assert max_model_len(None, 528, None) == 528
    assert max_model_len(None, None, 256) is None


def test_a_vision_language_models_context_is_its_text_configs():
    from transformers import AutoConfig

    from colossal_rl.config import EMBEDDED_VLM_DIR
    from colossal_rl.rollout.vllm_backend import model_context_length

    config = AutoConfig.from_pretrained(EMBEDDED_VLM_DIR)
    assert model_context_length(config) == 512 == config.get_text_config().max_position_embeddings
    assert model_context_length(AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)) == 256
    text_only = type("TransformersFiveVLConfig", (), {"get_text_config": lambda self: config.get_text_config()})()
    assert model_context_length(text_only) == 512  # no top-level max_position_embeddings, as in transformers 5


def test_a_config_validation_error_of_vllm_is_named_by_its_reason_not_its_link():
    from colossal_rl.rollout.vllm_backend import engine_start_failure

    error = ValueError(
        "1 validation error for ModelConfig\n  Value error, User-specified max_model_len (524) is greater than the "
        "derived max_model_len [type=value_error]\n    For further information visit https://errors.pydantic.dev/v"
    )
    message = engine_start_failure("m", error)
    assert "User-specified max_model_len (524)" in message and "further information" not in message


def test_greedy_prompts_are_repeated_sampled_ones_are_not():
    prompts = [[1, 2], [3]]
    assert request_prompts(prompts, 3, greedy=False) == prompts
    assert request_prompts(prompts, 2, greedy=True) == [[1, 2], [1, 2], [3], [3]]
    with pytest.raises(ValueError, match="empty prompt"):
        request_prompts([[1], []], 1, greedy=False)


def test_requests_carry_each_prompt_unpadded_with_its_own_seed():
    prompts = [[0, 5, 6], [7]]  # token 0 is the embedded model's pad *and* EOS: it must pass through untouched
    sampling = SamplingSettings(temperature=0.7, max_new_tokens=4)
    inputs, params = vllm_requests(prompts, 3, sampling, stop_token_ids=[0], seeds=[11, 12])
    assert inputs == [{"prompt_token_ids": [0, 5, 6]}, {"prompt_token_ids": [7]}]
    assert [(p["n"], p["seed"]) for p in params] == [(3, 11), (3, 12)]

    greedy = SamplingSettings(temperature=1.0, max_new_tokens=4, greedy=True)
    inputs, params = vllm_requests(prompts, 2, greedy, stop_token_ids=[0], seeds=[1, 2, 3, 4])
    assert [i["prompt_token_ids"] for i in inputs] == [[0, 5, 6], [0, 5, 6], [7], [7]]
    assert all(p["n"] == 1 and p["temperature"] == 0.0 for p in params)
    with pytest.raises(ValueError, match="2 seeds for 4 requests"):
        vllm_requests(prompts, 2, greedy, stop_token_ids=[0], seeds=[1, 2])


# --- image prompts ---------------------------------------------------------------------------------------------

PAD = 9  # <|image_pad|> of the prompts below; 7 and 8 stand for <|vision_start|> and <|vision_end|>


def vllm_073_expand(prompt: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """What vLLM 0.7.3's multimodal processor makes of a token prompt and ``len(counts)`` images: the prompt is
    taken as is (vllm/multimodal/processing.py:972-981), then the first ``len(counts)`` single pads, in order, each
    become their image's run (``_apply_prompt_replacements`` :1085-1154, ``_replace_matches`` :444-479); fewer pads
    than images fail its placeholder validation (:1177-1194)."""
    expanded, item = [], 0
    for token in prompt:
        if token == image_token_id and item < len(counts):
            expanded += [image_token_id] * counts[item]
            item += 1
        else:
            expanded.append(token)
    if item < len(counts):
        raise RuntimeError(f"Expected there to be {len(counts)} prompt replacements, found {item}")
    return expanded


def two_image_prompt() -> list[int]:
    return [1, 7] + [PAD] * 4 + [8, 2, 7] + [PAD] * 12 + [8, 3]  # images of 4 and 12 tokens


def test_vllm_would_expand_our_expanded_prompt_again_and_expands_the_collapsed_one_to_ours():
    ours = two_image_prompt()
    doubled = vllm_073_expand(ours, PAD, [4, 12])
    assert doubled.count(PAD) == 4 + 12 + (16 - 2) and doubled != ours  # the reason to collapse
    collapsed, runs = collapse_image_pads(ours, PAD)
    assert collapsed == [1, 7, PAD, 8, 2, 7, PAD, 8, 3]
    assert runs == [4, 12]
    assert vllm_073_expand(collapsed, PAD, runs) == ours
    assert collapse_image_pads([1, 2, 3], PAD) == ([1, 2, 3], [])


def test_image_requests_collapse_each_prompt_and_carry_its_raw_images():
    images = [["img0", "img1"], [], None]  # stand-ins for PIL images: they are passed through untouched
    prompts = [two_image_prompt(), [1, 2], [3]]
    engine_prompts, data = image_requests(prompts, images, image_token_id=PAD, tokens_per_image=[[4, 12], [], []])
    assert engine_prompts == [[1, 7, PAD, 8, 2, 7, PAD, 8, 3], [1, 2], [3]]
    assert data == [{"image": ["img0", "img1"]}, None, None]
    assert data[0]["image"][0] is images[0][0]
    assert image_requests(prompts, images, image_token_id=PAD)[0] == engine_prompts  # counts are optional

    with pytest.raises(ValueError, match="prompt 0 has 2 image placeholders but 1 images"):
        image_requests(prompts[:1], [["img0"]], image_token_id=PAD)
    with pytest.raises(ValueError, match=r"runs are \[4, 12\] tokens long, its images' grids say \[4, 16\]"):
        image_requests(prompts[:1], images[:1], image_token_id=PAD, tokens_per_image=[[4, 16]])
    with pytest.raises(ValueError, match="at most 1 per prompt: set --limit-images"):
        image_requests(prompts[:1], images[:1], image_token_id=PAD, max_images=1)
    with pytest.raises(ValueError, match="images for 1 prompts, 3 prompts"):
        image_requests(prompts, images[:1], image_token_id=PAD)


def test_image_token_counts_are_merged_patches():
    grid = torch.tensor([[1, 4, 4], [1, 6, 8]])
    vision = VisionInputs(pixel_values=torch.zeros(16 + 48, 3), image_grid_thw=grid)
    assert image_token_counts(vision, 2) == [4, 12]
    assert image_token_counts(None, 2) == []


def test_requests_of_image_prompts_one_per_prompt_or_per_greedy_sample():
    engine_prompts, data = image_requests([two_image_prompt(), [5]], [["a", "b"], []], image_token_id=PAD)
    sampling = SamplingSettings(temperature=0.7, max_new_tokens=4)
    inputs, params = vllm_requests(engine_prompts, 3, sampling, stop_token_ids=[0], seeds=[11, 12],
                                   multi_modal_data=data)  # fmt: skip
    assert inputs == [
        {"prompt_token_ids": [1, 7, PAD, 8, 2, 7, PAD, 8, 3], "multi_modal_data": {"image": ["a", "b"]}},
        {"prompt_token_ids": [5]},  # no images: no multi_modal_data (vLLM would run its processor on nothing)
    ]
    assert [(p["n"], p["seed"]) for p in params] == [(3, 11), (3, 12)]

    greedy = SamplingSettings(temperature=1.0, max_new_tokens=4, greedy=True)
    inputs, _ = vllm_requests(engine_prompts, 2, greedy, stop_token_ids=[0], seeds=[1, 2, 3, 4], multi_modal_data=data)
    assert [i.get("multi_modal_data") for i in inputs] == [{"image": ["a", "b"]}] * 2 + [None] * 2
    with pytest.raises(ValueError, match="multi_modal_data for 1 prompts, 2 prompts"):
        vllm_requests(engine_prompts, 1, sampling, stop_token_ids=[0], seeds=[1, 2], multi_modal_data=data[:1])


def test_rebatched_rows_carry_our_prompt_ids_and_refuse_another_expansion():
    ours = two_image_prompt()
    outputs = [RequestOutput("0", list(ours), [completion(0, [4, 0], [-0.5, -0.25], "stop")])]
    out = to_generation_output(outputs, num_samples=1, pad_token_id=0, decode=decode, prompt_ids=[ours])
    assert out.prompt_ids[0].tolist() == ours
    resized = [RequestOutput("0", vllm_073_expand(collapse_image_pads(ours, PAD)[0], PAD, [4, 9]), outputs[0].outputs)]
    with pytest.raises(ValueError, match=r"request 0 \(20 tokens\) is not ours \(23 tokens\).*min_pixels/max_pixels"):
        to_generation_output(resized, num_samples=1, pad_token_id=0, decode=decode, prompt_ids=[ours])
    with pytest.raises(ValueError, match="2 prompts for 1 vLLM request outputs"):
        to_generation_output(outputs, num_samples=1, pad_token_id=0, decode=decode, prompt_ids=[ours, ours])


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


@without_vllm
def test_vllm_is_not_installed_here():
    assert not backend_module.vllm_installed()


@without_vllm
def test_create_backend_without_vllm_says_where_vllm_runs():
    with pytest.raises(BackendUnavailableError, match=r"producers' own environment.*colossal_rl.producer_env build"):
        create_backend("vllm", str(EMBEDDED_MODEL_DIR))


def test_create_backend_picks_vllm_when_installed(monkeypatch):
    created = {}

    class FakeVllmBackend:
        def __init__(
            self, model_path, *, tensor_parallel_size, seed, engine, max_sequence_tokens, trust_remote_code, dtype,
            **image_options,
        ):  # fmt: skip
            created.update(model_path=model_path, tensor_parallel_size=tensor_parallel_size, seed=seed, dtype=dtype)
            created.update(engine=engine, max_sequence_tokens=max_sequence_tokens, trust_remote_code=trust_remote_code)
            # VllmBackend's vision-language options, which create_backend may pass on (data.limit_images etc.).
            assert set(image_options) <= {"images_per_prompt", "min_pixels", "max_pixels"}

    import colossal_rl.rollout.vllm_backend as vllm_backend

    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_backend, "VllmBackend", FakeVllmBackend)
    engine = VllmEngineConfig(gpu_memory_utilization=0.5)
    backend = create_backend(
        "vllm",
        "some/model",
        tensor_parallel_size=2,
        seed=3,
        vllm_engine=engine,
        max_sequence_tokens=100,
        trust_remote_code=True,
        weights_dtype="bfloat16",
    )
    assert isinstance(backend, FakeVllmBackend)
    assert created == {
        "model_path": "some/model",
        "tensor_parallel_size": 2,
        "seed": 3,
        "engine": engine,
        "max_sequence_tokens": 100,
        "trust_remote_code": True,
        "dtype": "bfloat16",
    }


def test_create_backend_refuses_unknown_names_and_tensor_parallel_transformers():
    with pytest.raises(ValueError, match="unknown inference backend"):
        create_backend("tgi", "m")
    with pytest.raises(ValueError, match="needs the vllm backend"):
        create_backend("transformers", str(EMBEDDED_MODEL_DIR), tensor_parallel_size=2)


BLOCK_VLLM = """
import importlib.abc, sys

class BlockVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)

sys.meta_path.insert(0, BlockVllm())
"""


def run_with_vllm_blocked(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which importing vLLM fails, whether or not it is installed."""
    return subprocess.run([sys.executable, "-c", BLOCK_VLLM + code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_vllm_modules_import_without_vllm():
    result = run_with_vllm_blocked(
        "import colossal_rl.rollout.backend, colossal_rl.rollout.vllm_backend, colossal_rl.rollout.vllm_weights\n"
        "import rl_example\n"
        "assert 'vllm' not in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_vllm_blocker_stops_an_import_of_vllm():
    # The check above can fail: VllmBackend imports vLLM in its constructor, and that import is refused.
    result = run_with_vllm_blocked("from colossal_rl.rollout.vllm_backend import VllmBackend\nVllmBackend('model')\n")
    assert result.returncode != 0
    assert "No module named 'vllm' (blocked by the test)" in result.stderr


# --- the command line ------------------------------------------------------------------------------------------


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


@without_vllm
def test_cli_accepts_vllm_without_vllm_in_the_trainers_environment():
    """vLLM runs in the producers' own environment (built when the run starts), never in this one."""
    config = parse("-b", "vllm", "-ptp", "2")
    assert (config.generation.backend, config.generation.tensor_parallel_size) == ("vllm", 2)


def test_cli_producer_tensor_parallelism_needs_vllm():
    with pytest.raises(UsageError, match="-ptp/--producer-tensor-parallel-size > 1 needs -b vllm"):
        parse("-ptp", "2")


def test_cli_vllm_engine_flags_reach_the_config(monkeypatch):
    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    default = parse("-b", "vllm").generation.vllm
    assert default == VllmEngineConfig()
    config = parse(
        "-b", "vllm", "--gpu-memory-utilization", "0.55", "--no-enforce-eager", "--no-enable-chunked-prefill",
        "--max-model-len", "4096", "-mpt", "512", "-mnt", "3584",
    )  # fmt: skip
    assert config.generation.vllm == VllmEngineConfig(
        gpu_memory_utilization=0.55, enforce_eager=False, enable_chunked_prefill=False, max_model_len=4096
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--gpu-memory-utilization", "0"), "--gpu-memory-utilization: must be in (0, 1]"),
        (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization: must be in (0, 1]"),
        (("--max-model-len", "0"), "--max-model-len: must be >= 1"),
        (("--max-model-len", "100", "-mpt", "96", "-mnt", "8"), "--max-model-len: 100 is shorter than"),
    ],
)
def test_cli_vllm_engine_flags_are_validated_by_name(monkeypatch, argv, message):
    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    with pytest.raises(UsageError) as caught:
        parse("-b", "vllm", *argv)
    assert str(caught.value).startswith(message)


def test_config_refuses_tensor_parallel_producers_without_vllm():
    from colossal_rl.config import ConfigError

    with pytest.raises(ConfigError, match="generation.tensor_parallel_size"):
        GenerationConfig(tensor_parallel_size=2).validate()
    GenerationConfig(backend="vllm", tensor_parallel_size=2).validate()


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_producer_asks_vllm_for_the_training_precision(monkeypatch, precision, dtype):
    """vLLM's "auto" would run a float32 config in float16: producers must hold what trainers send."""
    import dataclasses

    import colossal_rl.rollout.producer as producer_module
    from colossal_rl.config import RLConfig

    class Created(Exception):
        pass

    def fake_create_backend(*args, **kwargs):
        raise Created(kwargs)

    monkeypatch.setattr(producer_module, "create_backend", fake_create_backend)
    config = resolve(RLConfig())
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, precision=precision))
    with pytest.raises(Created) as created:
        producer_module.Producer(0, config, reward_scorer=None)
    assert created.value.args[0]["weights_dtype"] == dtype


# --- the whole backend, through a fake vllm module ---------------------------------------------------------------


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeLLM:
    """``vllm.LLM`` as far as the backend reaches it: records its keyword arguments and requests, and answers each
    request like vLLM 0.7.3 would: its own expansion of the image placeholders (the checkpoint's image processor
    with the engine's ``mm_processor_kwargs``, as vLLM runs it) as ``prompt_token_ids``, ``n`` completions."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.requests: list[dict] = []
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=()):
        raise AssertionError("not called in these tests (tests/vllm_engine loads weights into the real engine)")

    def generate(self, inputs, params, use_tqdm):
        from transformers import AutoProcessor

        self.requests, self.params = inputs, params
        outputs = []
        for number, (request, param) in enumerate(zip(inputs, params, strict=True)):
            prompt = request["prompt_token_ids"]
            images = (request.get("multi_modal_data") or {}).get("image", [])
            if images:
                processor = AutoProcessor.from_pretrained(self.kwargs["model"])
                pixels = self.kwargs.get("mm_processor_kwargs") or {}
                grids = processor.image_processor(images=images, **pixels)["image_grid_thw"]
                image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
                prompt = vllm_073_expand(prompt, image_token, (grids.prod(-1) // 4).tolist())
            completions = [completion(k, [40 + k, 0], [-0.5, -0.25], "stop") for k in range(param.n)]
            outputs.append(RequestOutput(str(number), prompt, completions))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__version__ = "0.32.0"
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    module.ModelRegistry = types.SimpleNamespace(
        get_supported_archs=lambda: ["Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"]
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an engine on GPUs: no CPU head_dim limits
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the backend sets it: restore it after the test
    # The producers' environment has torchvision (tests/vllm_engine checks it there); this one need not.
    monkeypatch.setattr("colossal_rl.rollout.vllm_backend.torchvision_import_error", lambda: None)
    FakeLLM.instances.clear()
    return module


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_random_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory) -> Path:
    """Three rows: two images (4 and 12 image tokens), one image, none."""
    directory = tmp_path_factory.mktemp("rows")
    draw_shapes(directory / "a.png", 2)
    draw_shapes(directory / "b.png", 3, size=(112, 84), seed=1)
    rows = [
        {"messages": {"role": "user", "content": "<image>and<image>: how many?"}, "gt_answer": "5",
         "images": ["a.png", "b.png"]},
        {"messages": {"role": "user", "content": "<image>How many?"}, "gt_answer": "3", "images": ["b.png"]},
        {"messages": {"role": "user", "content": "No picture."}, "gt_answer": "0"},
    ]  # fmt: skip
    path = directory / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_vllm_backend_of_a_vision_language_model_end_to_end(fake_vllm, vlm_dir, image_rows):
    from colossal_rl.rollout.vllm_backend import VllmBackend

    backend = VllmBackend(str(vlm_dir), images_per_prompt=2, max_pixels=12544)
    assert backend.processor is not None and backend.tokenizer is backend.processor.tokenizer
    (llm,) = FakeLLM.instances
    assert llm.kwargs["limit_mm_per_prompt"] == {"image": 2, "video": 0}
    assert llm.kwargs["mm_processor_kwargs"] == {"max_pixels": 12544}
    assert llm.kwargs["enable_chunked_prefill"] is True  # V1 chunks prompts with images
    assert backend.architecture == "Qwen2_5_VLForConditionalGeneration"

    # The producer's path: prompts encoded by the backend's processor, their VisionInputs and raw images.
    prompting = ImagePrompting(processor=backend.processor, max_pixels=12544)
    dataset = load_prompt_dataset(image_rows, backend.tokenizer, None, 512, None, prompting)
    indices = [0, 1, 2]
    vision = [dataset.vision_inputs(i) for i in indices]
    images = [dataset.raw_images(i) for i in indices]
    assert [len(i) for i in images] == [2, 1, 0] and images[0][1].size == (112, 84) and images[0][1].mode == "RGB"
    pad = backend.image_tokens.image_token_id
    assert [dataset.prompt_ids[i].count(pad) for i in indices] == [4 + 12, 12, 0]

    sampling = SamplingSettings(temperature=1.0, max_new_tokens=4)
    out = backend.generate([dataset.prompt_ids[i] for i in indices], 2, sampling, vision, images)
    assert [r["prompt_token_ids"].count(pad) for r in llm.requests] == [2, 1, 0]  # one pad per image
    assert [len(r.get("multi_modal_data", {}).get("image", [])) for r in llm.requests] == [2, 1, 0]
    assert llm.requests[0]["multi_modal_data"]["image"][0] is images[0][0]
    assert [p.n for p in llm.params] == [2, 2, 2]  # one request per prompt, as for text
    for row in range(6):  # our expanded ids, left-padded, group-major
        real = out.prompt_ids[row][out.prompt_mask[row].bool()].tolist()
        assert real == dataset.prompt_ids[indices[row // 2]]
    assert out.response_ids.shape == (6, 2)

    greedy = SamplingSettings(temperature=1.0, max_new_tokens=4, greedy=True)
    out = backend.generate([dataset.prompt_ids[0]], 3, greedy, vision[:1], images[:1])
    assert len(llm.requests) == 3 and all(r["multi_modal_data"]["image"] == images[0] for r in llm.requests)
    assert out.prompt_ids.tolist() == [dataset.prompt_ids[0]] * 3

    with pytest.raises(ValueError, match="pass images="):
        backend.generate([dataset.prompt_ids[0]], 1, sampling, vision[:1])
    with pytest.raises(ValueError, match="prompt 0 has 2 image placeholders but 1 images"):
        backend.generate([dataset.prompt_ids[0]], 1, sampling, None, [images[1]])


def test_a_vision_language_model_without_torchvision_is_refused_in_one_line_before_the_engine(
    fake_vllm, vlm_dir, monkeypatch
):
    from colossal_rl.rollout import vllm_backend

    missing = "ModuleNotFoundError: No module named 'torchvision'"
    monkeypatch.setattr(vllm_backend, "torchvision_import_error", lambda: missing)
    with pytest.raises(RuntimeError) as raised:
        vllm_backend.VllmBackend(str(vlm_dir))
    message = str(raised.value)
    assert message.startswith(f"the vLLM engine cannot serve {vlm_dir}:") and message.endswith("use -b transformers")
    assert "needs torchvision" in message and missing in message and "\n" not in message
    assert FakeLLM.instances == []  # no engine started
    vllm_backend.VllmBackend(str(EMBEDDED_MODEL_DIR))  # a text model does not need it


def test_vllm_backend_refuses_rows_whose_images_vllm_resizes_otherwise(fake_vllm, vlm_dir, image_rows):
    from colossal_rl.rollout.vllm_backend import VllmBackend

    # not what the prompts were made with (the fixture's processor resizes every image to 56 x 56)
    backend = VllmBackend(str(vlm_dir), images_per_prompt=2, min_pixels=112 * 112, max_pixels=112 * 112)
    dataset = load_prompt_dataset(image_rows, backend.tokenizer, None, 512, None, ImagePrompting(backend.processor))
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="is not ours.*min_pixels/max_pixels"):
        backend.generate([dataset.prompt_ids[1]], 1, sampling, [dataset.vision_inputs(1)], [dataset.raw_images(1)])


def test_vllm_backend_of_a_text_model_is_unchanged(fake_vllm):
    from colossal_rl.rollout.vllm_backend import VllmBackend

    backend = VllmBackend(str(EMBEDDED_MODEL_DIR))
    assert backend.processor is None
    (llm,) = FakeLLM.instances
    assert "limit_mm_per_prompt" not in llm.kwargs and llm.kwargs["enable_chunked_prefill"] is True
    prompt = backend.tokenizer.encode("12+3=")
    out = backend.generate([prompt], 2, SamplingSettings(temperature=1.0, max_new_tokens=4))
    assert llm.requests == [{"prompt_token_ids": prompt}]
    assert out.prompt_ids.tolist() == [prompt, prompt]
    with pytest.raises(ValueError, match="need a vision-language model"):
        backend.generate([prompt], 1, SamplingSettings(temperature=1.0, max_new_tokens=4), None, [["image"]])


def test_raw_images_of_a_text_dataset_are_empty():
    from colossal_rl.data import PromptDataset

    assert PromptDataset(path="x.jsonl", rows=[{}], prompt_ids=[[1]]).raw_images(0) == []
