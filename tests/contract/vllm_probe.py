"""Check, inside a process that can ``import vllm`` (the pinned release), every vLLM name our backend uses.

Each check returns its problems (none: the contract holds). What is checked comes from our code where it can:
keyword arguments from calling ``engine_kwargs``, ``vllm_requests``, ``image_requests`` and ``sampling_params_kwargs``
(a vision-language engine's on a random tiny Qwen2.5-VL, whose image request also goes through vLLM's own input
preprocessor and multimodal processor, on CPU, and must come out as our prompt ids and pixels); calls,
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
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle
import torch
import vllm
import vllm.envs
from vllm.config import ParallelConfig
from vllm.inputs.preprocess import InputPreprocessor
from vllm.model_executor.models import ModelRegistry
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sequence import Logprob, SequenceStatus
from vllm.transformers_utils.tokenizer_group import get_tokenizer_group
from vllm.utils import run_method
from vllm.worker.worker_base import WorkerWrapperBase
from vllm_uses import model_types, use_problems

from colossal_rl.config import EMBEDDED_MODEL_DIR, VllmEngineConfig
from colossal_rl.rollout import vllm_backend, vllm_weights
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.vision.prompts import encode_vision_prompt, with_image_parts
from colossal_rl.vision.rope import RopeTokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from vision_fixtures import build_random_vlm, draw_shapes  # noqa: E402

VL = "Qwen2_5_VLForConditionalGeneration"
PIXELS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
"""The pixel bounds of the probe's vision-language engine and of our encoding of its image prompt."""


def module_source(module: Any) -> str:
    return Path(inspect.getsourcefile(module)).read_text()


# --- the checks -------------------------------------------------------------------------------------------------


def engine_variants(vlm_dir: Path) -> list[dict[str, Any]]:
    """``vllm.LLM`` keyword arguments as our backend builds them: one GPU, tensor-parallel, explicit dtype, and a
    vision-language model's (``vlm_dir``: a tiny Qwen2.5-VL)."""
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
        vision_engine_kwargs(vlm_dir),
    ]


def vision_engine_kwargs(vlm_dir: Path) -> dict[str, Any]:
    return vllm_backend.engine_kwargs(str(vlm_dir), VllmEngineConfig(), tensor_parallel_size=1, seed=0, max_len=512,
                                      dtype="float32", vision_language=True, images_per_prompt=2, **PIXELS)  # fmt: skip


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
        if "limit_mm_per_prompt" in kwargs:
            held = model_config.multimodal_config and dict(model_config.multimodal_config.limit_per_prompt)
            if (
                held != kwargs["limit_mm_per_prompt"]
                or model_config.mm_processor_kwargs != kwargs["mm_processor_kwargs"]
            ):
                problems.append(f"vLLM holds limits {held} and processor kwargs {model_config.mm_processor_kwargs}")
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


def image_request(vlm_dir: Path) -> tuple[dict[str, Any], list[int], Any]:
    """Our ``TokensPrompt`` for a two-image prompt (4 and 12 image tokens) as the backend builds it, our prompt ids
    (pads expanded) and ``VisionInputs``."""
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    images = [
        Image.open(draw_shapes(vlm_dir / "probe_a.png", 2)).convert("RGB"),
        Image.open(draw_shapes(vlm_dir / "probe_b.png", 3, size=(112, 84), seed=1)).convert("RGB"),
    ]
    messages = with_image_parts([{"role": "user", "content": "<image>and<image>: how many?"}], 2, "probe")
    ours, vision = encode_vision_prompt(processor, messages, images, **PIXELS)
    tokens = RopeTokens.of(AutoConfig.from_pretrained(vlm_dir))
    counts = vllm_backend.image_token_counts(vision, tokens.spatial_merge_size)
    prompts, data = vllm_backend.image_requests([ours], [images], image_token_id=tokens.image_token_id,
                                                tokens_per_image=[counts], max_images=2)  # fmt: skip
    (request,), _ = vllm_backend.vllm_requests(prompts, 1, SamplingSettings(temperature=1.0, max_new_tokens=8),
                                               stop_token_ids=[0], seeds=[0], multi_modal_data=data)  # fmt: skip
    return request, ours, vision


def multimodal_prompt_problems(vlm_dir: Path, request: dict[str, Any], ours: list[int], vision: Any) -> list[str]:
    """vLLM's own input preprocessor (the engine's path from a ``TokensPrompt`` with ``multi_modal_data``: its
    multimodal processor, run on CPU) turns ``request`` into exactly our prompt ids, pixels and image grids."""
    model_config = vllm.EngineArgs(**vision_engine_kwargs(vlm_dir)).create_model_config()
    tokenizer = get_tokenizer_group(None, tokenizer_id=model_config.tokenizer, enable_lora=False, max_num_seqs=1,
                                    max_input_length=None, tokenizer_mode=model_config.tokenizer_mode,
                                    trust_remote_code=False, revision=None,
                                    truncation_side=model_config.truncation_side)  # fmt: skip
    try:
        processed = InputPreprocessor(model_config, tokenizer).preprocess(request, request_id="probe")
    except Exception as error:  # noqa: BLE001
        return [f"vLLM refuses our image request: {type(error).__name__}: {error}"]
    problems = []
    got = list(processed["prompt_token_ids"])
    if got != ours:
        pad = RopeTokens.of(model_config.hf_config).image_token_id
        problems.append(f"vLLM made {len(got)} prompt tokens ({got.count(pad)} image pads) of our request, whose "
                        f"prompt has {len(ours)} ({ours.count(pad)})")  # fmt: skip
    kwargs = processed["mm_kwargs"]
    if not torch.equal(kwargs["image_grid_thw"], vision.image_grid_thw) or not torch.equal(
        kwargs["pixel_values"], vision.pixel_values
    ):
        problems.append(f"vLLM's image grids {kwargs['image_grid_thw'].tolist()} or pixels differ from ours "
                        f"({vision.image_grid_thw.tolist()})")  # fmt: skip
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


def loader_problems(
    architectures: Iterable[str],
    stacked: Iterable[tuple[str, str, Any]],
    layouts: dict[str, vllm_weights.MultimodalNames] = vllm_weights.MULTIMODAL_NAMES,
) -> list[str]:
    """Each supported architecture resolves in vLLM's registry, its ``load_weights`` returns the loaded names and
    its module fuses q/k/v and gate/up exactly as ``STACKED_PARAMS`` says. A vision-language one
    (``MULTIMODAL_NAMES``): its ``hf_to_vllm_mapper`` renames prefixes as ours, its vision tower's loader fuses
    ``VISION_STACKED_PARAMS``, and its language model is the architecture we name, checked as a text one."""
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
        layout = layouts.get(arch)
        if layout is None:
            if ours not in tables:
                problems.append(f"{arch}: vLLM fuses {tables}, STACKED_PARAMS says {sorted(ours, key=str)}")
            continue
        mapper = getattr(getattr(cls, "hf_to_vllm_mapper", None), "orig_to_new_prefix", None)
        if list((mapper or {}).items()) != [tuple(pair) for pair in layout.hf_to_vllm_prefixes]:
            problems.append(f"{arch}: vLLM maps prefixes {mapper}, MULTIMODAL_NAMES says {layout.hf_to_vllm_prefixes}")
        vision = {tuple(row) for row in vllm_weights.VISION_STACKED_PARAMS}
        if vision not in tables:
            problems.append(f"{arch}: vLLM fuses {tables}, VISION_STACKED_PARAMS says {sorted(vision, key=str)}")
        source = inspect.getsource(cls.__init__)
        if f'architectures=["{layout.language_model}"]' not in source or "self.visual = " not in source:
            problems.append(f"{arch}: its language model is not a {layout.language_model} under language_model.")
        problems += loader_problems([layout.language_model], stacked)
    return problems


def every_noticed(*reports: list[str]) -> list[str]:
    """One control made of several planted mistakes: their problems, or none when any mistake went unnoticed."""
    return [problem for report in reports for problem in report] if all(reports) else []


def run_all() -> dict[str, dict[str, list[str]]]:
    with tempfile.TemporaryDirectory() as directory:
        return run_all_with(build_random_vlm(Path(directory) / "vlm"))


def run_all_with(vlm_dir: Path) -> dict[str, dict[str, list[str]]]:
    backend_source, weights_source = module_source(vllm_backend), module_source(vllm_weights)
    models = model_types(vllm_weights.SUPPORTED_ARCHITECTURES)
    inputs, params = request_parts(sampling_variants())
    request, ours, vision = image_request(vlm_dir)
    expanded_request = {**request, "prompt_token_ids": ours}  # what vLLM would expand a second time
    layout = vllm_weights.MULTIMODAL_NAMES[VL]
    misplaced_language_model = dataclasses.replace(layout, hf_to_vllm_prefixes=(("model.", "language_model."),))
    misspelled_output = real_outputs()
    delattr(misspelled_output[1].outputs[0], "finish_reason")
    checks = {
        "llm_keywords": llm_keyword_problems(engine_variants(vlm_dir)),
        "sampling_params": sampling_problems(params),
        "prompts": prompt_problems(inputs + [request]) + multimodal_prompt_problems(vlm_dir, request, ours, vision),
        "outputs": output_problems(real_outputs()),
        "finish_reasons": finish_reason_problems(backend_source),
        "backend_uses": use_problems(backend_source, "vllm_backend.py", models),
        "weights_uses": use_problems(weights_source, "vllm_weights.py", models),
        "environment": environment_problems(backend_source),
        "collective_rpc": rpc_problems(vllm_weights.worker_model),
        "model_loaders": loader_problems(vllm_weights.SUPPORTED_ARCHITECTURES, vllm_weights.STACKED_PARAMS),
    }
    controls = {
        "llm_keywords": every_noticed(
            llm_keyword_problems([{**engine_variants(vlm_dir)[0], "tensor_paralel_size": 2}]),
            # image options for a text model, which vLLM refuses (the probe builds real configs)
            llm_keyword_problems(
                [{**vision_engine_kwargs(vlm_dir), "model": str(EMBEDDED_MODEL_DIR), "max_model_len": None}]
            ),
        ),
        "sampling_params": sampling_problems([{**params[0], "max_token": 8}]),
        "prompts": every_noticed(
            prompt_problems([{"prompt_tokens_ids": [1, 2]}]),
            multimodal_prompt_problems(vlm_dir, expanded_request, ours, vision),
        ),
        "outputs": output_problems(misspelled_output),
        "finish_reasons": finish_reason_problems("done = completion.finish_reason == 'max_length'"),
        "backend_uses": use_problems("self.llm.generate(inputs, params, use_tqdmm=False)", "planted", models),
        "backend_chain": use_problems("self.llm.llm_engine.model_exector.driver_worker", "planted", models),
        "weights_uses": use_problems("worker.model_runner.modle.load_weights(weights)", "planted", models),
        "environment": environment_problems("os.environ.setdefault('VLLM_USE_V2', '0')"),
        "collective_rpc": rpc_problems(lambda worker: worker.model_runer.model),
        "model_loaders": every_noticed(
            loader_problems(["Qwen9ForCausalLM"], vllm_weights.STACKED_PARAMS),
            loader_problems([VL], vllm_weights.STACKED_PARAMS, {VL: misplaced_language_model}),
        ),
        "model_loaders_table": loader_problems(["Qwen2ForCausalLM"], [("qkv_proj", "q_proj", "query")]),
    }
    return {"checks": checks, "controls": controls}


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(run_all(), indent=1))
