"""The vLLM backend up to the engine call, on CPU without vLLM: sampling parameters, prompts, re-batching of
vLLM-shaped outputs into our layout (checked against the transformers backend's own output), backend selection
and the error when vLLM is missing.

The fakes below are shaped like vLLM 0.7.3's ``RequestOutput``/``CompletionOutput``/``Logprob``
(vllm/outputs.py, vllm/sequence.py); they stand for the engine, not for the code under test."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR, GenerationConfig, VllmEngineConfig
from colossal_rl.rollout import backend as backend_module
from colossal_rl.rollout.backend import (
    BackendUnavailableError,
    SamplingSettings,
    create_backend,
    eval_sampling,
    train_sampling,
)
from colossal_rl.rollout.vllm_backend import (
    engine_kwargs,
    max_model_len,
    pad_and_eos_token_ids,
    request_prompts,
    sampled_logprobs,
    sampling_params_kwargs,
    to_generation_output,
    vllm_requests,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root

from rl_example import UsageError, build_parser, config_from_args  # noqa: E402

without_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: this checks the behaviour without it"
)

# Field names of vllm.SamplingParams in vLLM 0.7.3 (vllm/sampling_params.py) that we set.
VLLM_073_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "max_tokens", "logprobs",
    "skip_special_tokens", "include_stop_str_in_output",
}  # fmt: skip

# Parameters of vllm.LLM.__init__ in vLLM 0.7.3 (vllm/entrypoints/llm.py) plus the EngineArgs fields
# (vllm/engine/arg_utils.py) it accepts through **kwargs, that we set.
VLLM_073_LLM_ARGUMENTS = {
    "model", "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization", "enforce_eager",
    "distributed_executor_backend", "enable_chunked_prefill", "max_model_len", "enable_prefix_caching",
    "trust_remote_code",
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
        -1,
        1.0,
    )
    assert (greedy_eval["max_tokens"], greedy_eval["stop"]) == (32, ["</answer>"])

    sampled_gen = GenerationConfig(temperature=0.8, top_k=40, top_p=0.95, eval_temperature=0.6)
    sampled_eval = sampling_params_kwargs(eval_sampling(sampled_gen), 1, stop_token_ids=[0], seed=5)
    assert (sampled_eval["n"], sampled_eval["temperature"], sampled_eval["top_k"], sampled_eval["top_p"]) == (
        1,
        0.6,
        40,
        0.95,
    )


# --- engine arguments ------------------------------------------------------------------------------------------


def test_engine_arguments_come_from_the_config_and_are_vllm_073_arguments():
    engine = VllmEngineConfig(gpu_memory_utilization=0.5, enforce_eager=False, enable_chunked_prefill=False)
    kwargs = engine_kwargs("/models/qwen", engine, tensor_parallel_size=2, seed=3, max_len=4096)
    assert set(kwargs) <= VLLM_073_LLM_ARGUMENTS
    assert kwargs["model"] == "/models/qwen"
    assert (kwargs["gpu_memory_utilization"], kwargs["enforce_eager"], kwargs["enable_chunked_prefill"]) == (
        0.5,
        False,
        False,
    )
    assert (kwargs["tensor_parallel_size"], kwargs["seed"], kwargs["max_model_len"]) == (2, 3, 4096)
    assert kwargs["distributed_executor_backend"] == "mp"  # not Ray's executor inside a Ray actor
    assert kwargs["enable_prefix_caching"] is False  # caches must not outlive a weight update
    assert kwargs["trust_remote_code"] is False  # the model's own code runs only when asked
    trusted = engine_kwargs("m", engine, tensor_parallel_size=1, seed=0, max_len=None, trust_remote_code=True)
    assert trusted["trust_remote_code"] is True
    one_gpu = engine_kwargs("m", VllmEngineConfig(), tensor_parallel_size=1, seed=0, max_len=None)
    assert one_gpu["distributed_executor_backend"] is None
    assert (one_gpu["gpu_memory_utilization"], one_gpu["enforce_eager"], one_gpu["enable_chunked_prefill"]) == (
        0.7,
        True,
        True,
    )


def test_max_model_len_is_configured_or_prompt_plus_response_capped_by_the_model():
    assert max_model_len(8192, 4096, 32768) == 8192
    assert max_model_len(None, 512 + 3584, 32768) == 4096
    assert max_model_len(None, 512 + 16, 256) == 256  # the embedded model's context
    assert max_model_len(None, 528, None) == 528
    assert max_model_len(None, None, 256) is None


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
def test_create_backend_without_vllm_says_what_to_install():
    with pytest.raises(BackendUnavailableError, match=r'pip install -e "\.\[gpu\]"'):
        create_backend("vllm", str(EMBEDDED_MODEL_DIR))


def test_create_backend_picks_vllm_when_installed(monkeypatch):
    created = {}

    class FakeVllmBackend:
        def __init__(
            self, model_path, *, tensor_parallel_size, seed, engine, max_sequence_tokens, trust_remote_code, dtype
        ):
            created.update(model_path=model_path, tensor_parallel_size=tensor_parallel_size, seed=seed, dtype=dtype)
            created.update(engine=engine, max_sequence_tokens=max_sequence_tokens, trust_remote_code=trust_remote_code)

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
    config = RLConfig()
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, precision=precision))
    with pytest.raises(Created) as created:
        producer_module.Producer(0, config, reward_scorer=None)
    assert created.value.args[0]["weights_dtype"] == dtype
