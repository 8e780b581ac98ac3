"""Check, inside a process that can ``import vllm`` (the pinned release), every vLLM name our backend uses.

Each check returns its problems (none: the contract holds). What is checked comes from our code where it can:
keyword arguments from calling ``engine_kwargs``, ``vllm_requests`` and ``sampling_params_kwargs``; calls,
attribute paths, compared finish reasons and environment variables from the source (AST) of ``vllm_backend.py``
and ``vllm_weights.py``; output fields by running ``to_generation_output`` and ``worker_model`` on real vLLM
objects (``vllm_uses.py`` does the source part). Each check also runs once on a planted mistake (a "control"),
which it must report.

No GPU is needed. Usage: ``python vllm_probe.py RESULT.json``; writes ``{"checks": {name: [problem]},
"controls": {name: [problem]}}``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle
import torch
import vllm
import vllm.envs
from vllm.config import ParallelConfig
from vllm.model_executor.models import ModelRegistry
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sequence import Logprob, SequenceStatus
from vllm.utils import run_method
from vllm.worker.worker_base import WorkerWrapperBase
from vllm_uses import model_types, use_problems

from colossal_rl.config import EMBEDDED_MODEL_DIR, VllmEngineConfig
from colossal_rl.rollout import vllm_backend, vllm_weights
from colossal_rl.rollout.backend import SamplingSettings


def module_source(module: Any) -> str:
    return Path(inspect.getsourcefile(module)).read_text()


# --- the checks -------------------------------------------------------------------------------------------------


def engine_variants() -> list[dict[str, Any]]:
    """``vllm.LLM`` keyword arguments as our backend builds them: one GPU, tensor-parallel, explicit dtype."""
    model = str(EMBEDDED_MODEL_DIR)
    engine = VllmEngineConfig(max_model_len=128)
    return [
        vllm_backend.engine_kwargs(model, engine, tensor_parallel_size=1, seed=0, max_len=128),
        vllm_backend.engine_kwargs(
            model,
            VllmEngineConfig(),
            tensor_parallel_size=2,
            seed=3,
            max_len=None,
            dtype="float32",
            trust_remote_code=True,
        ),  # fmt: skip
    ]


def llm_keyword_problems(variants: list[dict[str, Any]]) -> list[str]:
    """Each keyword is an ``LLM.__init__`` parameter or an ``EngineArgs`` field (LLM passes the rest on), and the
    values build vLLM's model and parallel configs for the embedded model (the device-independent part)."""
    llm_parameters = set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    engine_fields = {field.name for field in dataclasses.fields(vllm.EngineArgs)}
    parallel_parameters = set(inspect.signature(ParallelConfig).parameters)
    problems = []
    for kwargs in variants:
        unknown = sorted(set(kwargs) - llm_parameters - engine_fields)
        if unknown:
            problems.append(f"vllm.LLM takes no {unknown} (neither LLM.__init__ nor EngineArgs)")
            continue
        try:
            model_config = vllm.EngineArgs(**kwargs).create_model_config()
            ParallelConfig(**{k: v for k, v in kwargs.items() if k in parallel_parameters})
        except Exception as error:  # noqa: BLE001 - any refusal is the finding
            problems.append(f"vLLM refuses {kwargs}: {type(error).__name__}: {error}")
            continue
        if kwargs["dtype"] != "auto" and model_config.dtype != getattr(torch, kwargs["dtype"]):
            problems.append(f"dtype={kwargs['dtype']!r} gave {model_config.dtype}")
    return problems


def sampling_variants() -> list[SamplingSettings]:
    return [
        SamplingSettings(temperature=1.0, max_new_tokens=8),
        SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, stop_strings=("</answer>",)),
        SamplingSettings(temperature=1.0, max_new_tokens=8, greedy=True),
    ]


def request_parts(settings: list[SamplingSettings]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    inputs, params = [], []
    for sampling in settings:
        count = 2 * (3 if sampling.greedy else 1)
        more_inputs, more_params = vllm_backend.vllm_requests(
            [[5, 6, 7], [8, 9]], 3, sampling, stop_token_ids=[0], seeds=list(range(count))
        )
        inputs += more_inputs
        params += more_params
    return inputs, params


def sampling_problems(params: list[dict[str, Any]]) -> list[str]:
    """``SamplingParams(**kwargs)`` accepts each request's arguments and keeps every value as given."""
    problems = []
    for kwargs in params:
        try:
            built = vllm.SamplingParams(**kwargs)
        except Exception as error:  # noqa: BLE001
            problems.append(f"SamplingParams refuses {kwargs}: {type(error).__name__}: {error}")
            continue
        for key, value in kwargs.items():
            kept = getattr(built, key, None)
            if kept != value and not (value is None and kept == []):  # vLLM turns stop=None into []
                problems.append(f"SamplingParams({key}={value!r}) holds {kept!r}")
    return problems


def prompt_problems(inputs: list[dict[str, Any]]) -> list[str]:
    """Our request dicts are ``vllm.inputs.TokensPrompt``s: known keys, required keys present."""
    allowed, required = set(vllm.inputs.TokensPrompt.__annotations__), set(vllm.inputs.TokensPrompt.__required_keys__)
    problems = []
    for prompt in inputs:
        if set(prompt) - allowed or required - set(prompt):
            problems.append(f"{sorted(prompt)} is not a TokensPrompt (keys {sorted(allowed)}, required {required})")
    return problems


def real_outputs() -> list[RequestOutput]:
    """Two requests of vLLM's own output classes: one stopped on EOS, one cut by max_tokens."""

    def completion(index: int, tokens: list[int], reason: str) -> CompletionOutput:
        logprobs = [{token: Logprob(logprob=-0.1 * (i + 1))} for i, token in enumerate(tokens)]
        return CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                                finish_reason=reason)  # fmt: skip

    return [
        RequestOutput("0", None, [5, 6, 7], None, [completion(1, [3, 0], "stop"), completion(0, [4], "stop")], True),
        RequestOutput("1", None, [8, 9], None, [completion(0, [4, 4, 4], "length"), completion(1, [0], "stop")], True),
    ]


def output_problems(outputs: list[RequestOutput]) -> list[str]:
    """``to_generation_output`` reads real ``RequestOutput``/``CompletionOutput``/``Logprob`` objects correctly."""
    try:
        out = vllm_backend.to_generation_output(outputs, num_samples=2, pad_token_id=0, decode=lambda r: [""] * len(r))
    except Exception as error:  # noqa: BLE001
        return [f"to_generation_output fails on vLLM's output classes: {type(error).__name__}: {error}"]
    problems = []
    if out.truncated.tolist() != [False, False, True, False]:
        problems.append(f"truncated {out.truncated.tolist()}: finish_reason 'length' not read as truncation")
    if out.response_ids[0, :1].tolist() != [4] or abs(out.behaviour_logprobs[2, 2].item() + 0.3) > 1e-6:
        problems.append("completions or log-probs not taken in vLLM's index order")
    return problems


def finish_reason_problems(source: str) -> list[str]:
    """Every string our code compares ``finish_reason`` with is a finish reason vLLM reports."""
    reported = {SequenceStatus.get_finished_reason(status) for status in SequenceStatus} - {None}
    compared = {
        comparator.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "finish_reason"
        for comparator in node.comparators
        if isinstance(comparator, ast.Constant)
    }
    return [
        f"finish_reason {reason!r} is never reported by vLLM ({sorted(reported)})" for reason in compared - reported
    ]


def environment_problems(source: str) -> list[str]:
    """Every ``VLLM_*`` string in our code names one of vLLM's environment variables."""
    names = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    unknown = {name for name in names if name.startswith("VLLM_")} - set(vllm.envs.environment_variables)
    return [f"{name} is not a vLLM {vllm.__version__} environment variable" for name in sorted(unknown)]


def rpc_problems(worker_function: Callable[[Any], Any]) -> list[str]:
    """collective_rpc's ``run_method`` hands ``worker_function`` a worker whose ``model_runner.model`` it reaches:
    directly (multiprocess workers get the worker), through ``WorkerWrapperBase`` (the driver), and as the
    cloudpickled bytes the multiprocess executor sends. Also: this vLLM routes weights through collective_rpc."""
    model = torch.nn.Linear(1, 1)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    wrapper = object.__new__(WorkerWrapperBase)
    wrapper.worker = worker
    dispatches = {
        "worker": (worker, worker_function),
        "WorkerWrapperBase": (wrapper, worker_function),
        "WorkerWrapperBase, cloudpickled": (wrapper, cloudpickle.dumps(worker_function)),
    }
    problems = []
    for label, (target, method) in dispatches.items():
        try:
            if run_method(target, method, (), {}) is not model:
                problems.append(f"run_method({label}) did not reach the model")
        except Exception as error:  # noqa: BLE001
            problems.append(f"run_method({label}): {type(error).__name__}: {error}")
    has_rpc = hasattr(vllm.LLM, "collective_rpc")
    route = vllm_weights.weight_load_route(vllm.__version__, has_collective_rpc=has_rpc, tensor_parallel_size=2)
    if route != "collective_rpc" or vllm_weights.untested_version_warning(vllm.__version__) is not None:
        problems.append(f"vLLM {vllm.__version__}: route {route!r} or an untested-version warning")
    return problems


def stacked_params_tables(source: str) -> list[set[tuple[Any, ...]]]:
    """Every ``stacked_params_mapping = [...]`` literal of a vLLM model module, leading dots of names removed."""
    tables = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "stacked_params_mapping" for t in node.targets):
            rows = ast.literal_eval(node.value)
            tables.append({tuple(x.lstrip(".") if isinstance(x, str) else x for x in row) for row in rows})
    return tables


def loader_problems(architectures: Iterable[str], stacked: Iterable[tuple[str, str, Any]]) -> list[str]:
    """Each supported architecture resolves in vLLM's registry, its ``load_weights`` returns the loaded names and
    its module fuses q/k/v and gate/up exactly as ``STACKED_PARAMS`` says."""
    ours = {(fused, part, shard) for fused, part, shard in stacked}
    problems = []
    for arch in sorted(architectures):
        # resolve_model_cls falls back to a generic Transformers model for names it does not know: check the name.
        if arch not in ModelRegistry.get_supported_archs():
            problems.append(f"{arch} is not one of vLLM {vllm.__version__}'s architectures")
            continue
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        returned = str(inspect.signature(cls.load_weights).return_annotation)
        if returned not in ("typing.Set[str]", "set[str]"):
            problems.append(f"{arch}.load_weights returns {returned}, not the set of loaded names")
        tables = stacked_params_tables(inspect.getsource(inspect.getmodule(cls)))
        if ours not in tables:
            problems.append(f"{arch}: vLLM fuses {tables}, STACKED_PARAMS says {sorted(ours, key=str)}")
    return problems


def run_all() -> dict[str, dict[str, list[str]]]:
    backend_source, weights_source = module_source(vllm_backend), module_source(vllm_weights)
    models = model_types(vllm_weights.SUPPORTED_ARCHITECTURES)
    inputs, params = request_parts(sampling_variants())
    misspelled_output = real_outputs()
    delattr(misspelled_output[1].outputs[0], "finish_reason")
    checks = {
        "llm_keywords": llm_keyword_problems(engine_variants()),
        "sampling_params": sampling_problems(params),
        "prompts": prompt_problems(inputs),
        "outputs": output_problems(real_outputs()),
        "finish_reasons": finish_reason_problems(backend_source),
        "backend_uses": use_problems(backend_source, "vllm_backend.py", models),
        "weights_uses": use_problems(weights_source, "vllm_weights.py", models),
        "environment": environment_problems(backend_source),
        "collective_rpc": rpc_problems(vllm_weights.worker_model),
        "model_loaders": loader_problems(vllm_weights.SUPPORTED_ARCHITECTURES, vllm_weights.STACKED_PARAMS),
    }
    controls = {
        "llm_keywords": llm_keyword_problems([{**engine_variants()[0], "tensor_paralel_size": 2}]),
        "sampling_params": sampling_problems([{**params[0], "max_token": 8}]),
        "prompts": prompt_problems([{"prompt_tokens_ids": [1, 2]}]),
        "outputs": output_problems(misspelled_output),
        "finish_reasons": finish_reason_problems("done = completion.finish_reason == 'max_length'"),
        "backend_uses": use_problems("self.llm.generate(inputs, params, use_tqdmm=False)", "planted", models),
        "backend_chain": use_problems("self.llm.llm_engine.model_exector.driver_worker", "planted", models),
        "weights_uses": use_problems("worker.model_runner.modle.load_weights(weights)", "planted", models),
        "environment": environment_problems("os.environ.setdefault('VLLM_USE_V2', '0')"),
        "collective_rpc": rpc_problems(lambda worker: worker.model_runer.model),
        "model_loaders": loader_problems(["Qwen9ForCausalLM"], vllm_weights.STACKED_PARAMS),
        "model_loaders_table": loader_problems(["Qwen2ForCausalLM"], [("qkv_proj", "q_proj", "query")]),
    }
    return {"checks": checks, "controls": controls}


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(run_all(), indent=1))
