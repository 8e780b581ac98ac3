"""Run by ``test_vllm_engine.py`` inside the producers' environment (real vLLM, its own torch): drive ``VllmBackend``
on CPU and write what it returned as JSON, for the trainers' environment to check against its own forward.

    <producer python> engine_checks.py request.json result.json

Per case: start the engine (or record the one-line start failure), generate sampled, greedy and stop-string rows,
load the weights file given (the "sync"), generate again with the same seeds, and read the weights back; with
``workers_weights``, a second sync received by the engine's workers, generated from again. A case with
``vision_rows`` (a vision-language model) encodes them with the backend's processor, as a producer does, generates
with their images, writes their processed images (what the trainers would receive) to ``vision_file`` and records
the installed vLLM's Qwen2.5-VL name mappers; ``language_only_weights`` is a second load without the vision tower
(a frozen tower's sync), generated from again. A case with ``continuous_max_new_tokens`` also runs the
continuous-batching checks (``continuous_batching``) and makes its load through ``EngineService`` while prompts decode
(``load_at_a_safe_point``); its later generations then run beside the batcher's requests. A case with
``episodes`` runs multi-turn episodes through the backend before any load (``multi_turn_episodes``). A case with
``partial_weights`` makes its loads mid-flight with partial rollouts (``partial_rollouts``): those weights, then
``weights`` (which the later generations hold).
"""

from __future__ import annotations

import json
import sys
import time


def output_to_json(output) -> dict:
    return {
        "prompt_ids": output.prompt_ids.tolist(),
        "prompt_mask": output.prompt_mask.tolist(),
        "response_ids": output.response_ids.tolist(),
        "response_mask": output.response_mask.tolist(),
        "behaviour_logprobs": output.behaviour_logprobs.tolist(),
        "truncated": output.truncated.tolist(),
        "responses": list(output.responses),
    }


def generate_all(backend, case: dict, prompts: list[list[int]], vision=None, images=None) -> dict:
    import torch

    from colossal_rl.rollout.backend import SamplingSettings

    new, extra = case["max_new_tokens"], {"vision": vision, "images": images} if images is not None else {}
    torch.manual_seed(0)
    sampled = backend.generate(prompts, 4, SamplingSettings(temperature=case["temperature"], max_new_tokens=new),
                               **extra)  # fmt: skip
    greedy = backend.generate(prompts, 2, SamplingSettings(temperature=1.0, greedy=True, max_new_tokens=new), **extra)
    torch.manual_seed(0)
    stops = SamplingSettings(temperature=1.0, max_new_tokens=new, stop_strings=tuple(case["stop_strings"]))
    stopped = backend.generate(prompts, 4, stops, **extra)
    return {"sampled": output_to_json(sampled), "greedy": output_to_json(greedy), "stopped": output_to_json(stopped)}


def continuous_batching(backend, case: dict, prompts: list[list[int]]) -> dict:
    """``--continuous-batching`` on this engine (``rollout/vllm_continuous.py``), before any weight load: greedy
    groups of prompts submitted at different steps (the longest first, the shortest one step later; 4 rows at most,
    so two prompts wait), next to ``generate``'s for the same prompts; then sampled groups with ``generate``'s seeds."""
    import torch

    from colossal_rl.rollout.backend import SamplingSettings

    greedy = SamplingSettings(temperature=1.0, greedy=True, max_new_tokens=case["continuous_max_new_tokens"])
    reference = backend.generate(prompts, 2, greedy)  # LLM.generate: no batcher yet
    lengths = reference.response_mask.sum(1)[::2].tolist()
    long, short = lengths.index(max(lengths)), lengths.index(min(lengths))
    batcher = backend.continuous_batcher(greedy, 2, max_rows=4)
    engine = backend.llm.llm_engine
    submitted, owners, returned = {}, {}, []
    most_requests, waited, step = 0, False, 0
    owners[batcher.submit(prompts[long])] = long
    submitted[long] = step
    while len(returned) < len(prompts):
        if step == 1:
            for index in [short] + [i for i in range(len(prompts)) if i not in (long, short)]:
                owners[batcher.submit(prompts[index])] = index
                submitted[index] = step
        groups = batcher.step()
        step += 1
        returned += [(step, owners[g.request_id], g) for g in groups]
        most_requests = max(most_requests, engine.get_num_unfinished_requests())
        waited = waited or batcher.waiting_prompts > 0
    in_order = [g for _, _, g in sorted(returned, key=lambda r: r[1])]
    torch.manual_seed(0)  # as generate_all's sampled run: the same seeds, in the same order
    sampling = SamplingSettings(temperature=case["temperature"], max_new_tokens=case["max_new_tokens"])
    sampled_batcher = backend.continuous_batcher(sampling, 4, max_rows=16)
    sampled_ids = [sampled_batcher.submit(prompt) for prompt in prompts]
    sampled = {g.request_id: g for g in sampled_batcher.run()}
    return {
        "reference_greedy": output_to_json(reference),
        "greedy": output_to_json(backend.output_of_groups(prompts, in_order, greedy)),
        "long_short": [long, short],
        "submitted_at": [submitted[i] for i in range(len(prompts))],
        "returned": [[step, index] for step, index, _ in returned],
        "most_engine_requests": most_requests,
        "waited": waited,
        "sampled": output_to_json(backend.output_of_groups(prompts, [sampled[i] for i in sampled_ids], sampling)),
    }


def load_at_a_safe_point(backend, case: dict, prompts: list[list[int]], weights) -> tuple:
    """The weight load of a continuous-batching producer, asked for while one caller's prompts decode on
    ``EngineService`` and a second caller's arrive: it runs once none of their requests is in the engine (each group
    records the version it was admitted under), and a call needing the new version gets groups sampled with it.
    Returns the service (still running) and what was seen."""
    import threading

    from colossal_rl.rollout.backend import SamplingSettings
    from colossal_rl.rollout.engine_service import EngineService

    sampling = SamplingSettings(temperature=case["temperature"], max_new_tokens=case["max_new_tokens"])
    service = EngineService(backend.continuous_batcher(sampling, 4, max_rows=16))
    engine, chunks, calls, seen = backend.llm.llm_engine, [prompts[:2], prompts[2:]], {}, {}

    def call(number: int) -> None:
        calls[number] = service.generate(chunks[number], min_version=0, timeout_s=300)

    def load() -> None:
        seen["engine_requests_at_load"] = engine.get_num_unfinished_requests()
        backend.load_weights(weights)

    callers = [threading.Thread(target=call, args=(number,)) for number in range(2)]
    callers[0].start()
    deadline = time.monotonic() + 300
    while service.batcher.running_rows == 0 and 0 not in calls and time.monotonic() < deadline:
        time.sleep(0.001)
    seen["rows_when_asked"] = service.batcher.running_rows
    callers[1].start()
    service.load_weights(load, 1, timeout_s=300)
    for caller in callers:
        caller.join(300)
    after = service.generate(prompts, min_version=1, timeout_s=300)
    return service, seen | {
        "callers": [
            {
                "versions": [g.policy_version for g in calls[n]],
                "output": output_to_json(backend.output_of_groups(chunks[n], calls[n], sampling)),
            }
            for n in range(2)
        ],  # fmt: skip
        "versions_after": [g.policy_version for g in after],
        "after": output_to_json(backend.output_of_groups(prompts, after, sampling)),
    }


def partial_rollouts(backend, case: dict, prompts: list[list[int]], weights: list) -> dict:
    """``--partial-rollouts`` on this engine (``rollout/vllm_partial_rollouts.py``): twice, a weight load lands
    while samples run at different depths (two prompts admitted ``partial_steps_before`` engine steps before it, a
    third 3 steps before it, a fourth after it). First sampled groups, version 1 loaded through the producer's RPC;
    then greedy ones, version 2 received by the engine's workers. Each generation's rows, their token versions, and
    the tokens each sample had when the load landed."""
    import torch

    from colossal_rl.rollout.backend import SamplingSettings

    new = case["partial_max_new_tokens"]
    plans = [
        ("sampled", SamplingSettings(temperature=case["temperature"], max_new_tokens=new), 2),
        ("greedy", SamplingSettings(temperature=1.0, greedy=True, max_new_tokens=new), 1),
    ]
    result = {}
    for version, (name, sampling, samples) in enumerate(plans, start=1):
        torch.manual_seed(version)
        batcher = backend.continuous_batcher(sampling, samples, max_rows=16, partial_rollouts=True)
        batcher.policy_version = version - 1  # what the engine holds (a producer's one batcher counts from 0)
        order, groups = {}, []
        for index in (0, 1):
            order[batcher.submit(prompts[index])] = index
        for _ in range(case["partial_steps_before"]):
            groups += batcher.step()
        order[batcher.submit(prompts[2])] = 2
        for _ in range(3):
            groups += batcher.step()
        batcher.before_new_weights()
        at_load = {order[g.request_id]: [len(s.tokens) for s in g.samples] for g in batcher._running.values()}
        in_engine = backend.llm.llm_engine.get_num_unfinished_requests()
        if version == 1:
            backend.load_weights(weights[version - 1])
        else:
            receive_in_workers(backend, weights[version - 1], 1, version=version)
        batcher.take_new_weights(version)
        order[batcher.submit(prompts[3])] = 3
        groups += batcher.run()
        groups.sort(key=lambda g: order[g.request_id])
        output = backend.output_of_groups(prompts, groups, sampling)
        result[name] = output_to_json(output) | {
            "token_versions": output.token_versions.tolist(),
            "tokens_at_load": [at_load.get(i) for i in range(len(prompts))],
            "engine_requests_at_load": in_engine,
        }
    return result


def receive_in_workers(backend, weights, tensor_parallel_size: int, version: int = 1) -> None:
    """A sync the way a run makes it with ``--vllm-weight-receive workers``: this process hosts the weight-sync group
    as its sender (a trainer's part), every engine worker joins it as one of the producer's ranks and receives
    ``version`` (the engine holding ``version - 1``). The sender's device comes from ``default_device``, as the
    workers' does (``vllm_worker.py``): on a GPU both sides speak NCCL, on CPU gloo."""
    from concurrent.futures import ThreadPoolExecutor

    from colossal_rl.comm.process_group import default_device, find_free_port
    from colossal_rl.comm.weight_sync.bucketed import host_as_sender
    from colossal_rl.comm.weight_sync.modes import plan_routes
    from colossal_rl.comm.weight_sync.stages import stage_group_name

    port = find_free_port()
    _, routes = plan_routes("broadcast", sender_nodes=["here"], producer_nodes=["here"],
                            addresses=[("127.0.0.1", port)], run_dir=".", formation=1,
                            receivers_per_producer=[tensor_parallel_size])  # fmt: skip
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-sender") as pool:
        hosting = pool.submit(host_as_sender, host="127.0.0.1", port=port, world_size=1 + tensor_parallel_size,
                              state_dict=weights, timeout_s=120.0, transport="torch", name=stage_group_name(0),
                              device=default_device())  # fmt: skip
        backend.join_weight_sync(routes[0], timeout_s=120.0, transport="torch")
        sender = hosting.result(timeout=150)
        sending = pool.submit(sender.send, weights, version)
        backend.receive_weights(version, loaded_version=version - 1)
        sending.result(timeout=150)
    sender.close()


class CalculatorEveryTurn:
    """A tool environment that answers every policy turn with a calculator result and is never done: each episode
    runs ``max_turns`` policy turns with tool results between them (the engine test's models never call a tool
    themselves)."""

    def reset(self, row: dict) -> list[dict]:
        self.row = row
        return [{"role": "user", "content": row["question"]}]

    def step(self, text: str):
        from colossal_rl.environments.base import StepResult
        from colossal_rl.environments.calculator import evaluate, format_value

        value = format_value(evaluate(self.row["question"].rstrip("=")))
        return StepResult(observation=({"role": "tool", "name": "calculator", "content": value},), tool_calls=1)

    def close(self) -> None:
        pass


class RecordingBackend:
    """The backend, each generate call's prompts and output recorded: every policy turn of the episodes."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def generate(self, prompts, num_samples, sampling, vision=None, images=None):
        output = self.backend.generate(prompts, num_samples, sampling)
        self.calls.append({"prompts": [list(p) for p in prompts], **output_to_json(output)})
        return output


def multi_turn_episodes(backend, case: dict) -> dict:
    """``case["episodes"]`` (questions, samples, limits) run by ``run_episodes`` through the backend: each
    turn's generate call and the episodes, collated as a producer's rollout batch."""
    import torch

    from colossal_rl.rollout.backend import SamplingSettings
    from colossal_rl.rollout.chat_turns import ChatTurns
    from colossal_rl.rollout.multi_turn import MultiTurnLimits, collate, run_episodes

    spec = case["episodes"]
    rows = [{"question": q} for q in spec["questions"] for _ in range(spec["samples"])]
    recording = RecordingBackend(backend)
    sampling = SamplingSettings(temperature=case["temperature"], max_new_tokens=case["max_new_tokens"])
    limits = MultiTurnLimits(max_turns=spec["max_turns"], max_total_tokens=spec["max_total_tokens"])
    torch.manual_seed(0)
    started = time.perf_counter()
    episodes = run_episodes(recording, ChatTurns(backend.tokenizer), [CalculatorEveryTurn() for _ in rows], rows,
                            sampling, limits)  # fmt: skip
    batch = collate(episodes, backend.pad_token_id)
    return {
        "seconds": time.perf_counter() - started,
        "calls": recording.calls,
        "turns": [[[t.generated_tokens, t.observation_tokens] for t in e.turns] for e in episodes],
        "ends": [e.end for e in episodes],
        "texts": [list(e.turn_texts) for e in episodes],
        "batch": {name: getattr(batch, name).tolist() for name in (
            "prompt_ids", "prompt_mask", "response_ids", "response_mask", "policy_mask", "behaviour_logprobs")},
    }  # fmt: skip


def vision_prompts(backend, case: dict) -> tuple[list[list[int]], list, list]:
    """The case's image rows encoded as a producer encodes them (prompt ids, VisionInputs, raw images); the
    processed images are saved for the trainers' side."""
    from pathlib import Path

    from safetensors.torch import save_file

    from colossal_rl.vision.prompts import encode_vision_prompt, open_image, with_image_parts

    prompts, vision, images = [], [], []
    for index, row in enumerate(case["vision_rows"]):
        row_images = [open_image(path, Path("/"), f"row {index}") for path in row["images"]]
        messages = with_image_parts(row["messages"], len(row_images), f"row {index}")
        ids, inputs = encode_vision_prompt(backend.processor, messages, row_images)
        prompts.append(ids)
        vision.append(inputs)
        images.append(row_images)
    tensors = {f"pixel_values.{i}": v.pixel_values.contiguous() for i, v in enumerate(vision)}
    tensors |= {f"image_grid_thw.{i}": v.image_grid_thw.contiguous() for i, v in enumerate(vision)}
    save_file(tensors, case["vision_file"])
    return prompts, vision, images


def qwen2_5_vl_mappers() -> dict:
    """The installed vLLM's Qwen2.5-VL weight-name mappers (what ``vllm_weights.MULTIMODAL_NAMES`` mirrors)."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer, Qwen2_5_VLForConditionalGeneration

    stacked = Qwen2_5_VisionTransformer.hf_to_vllm_mapper.orig_to_new_stacked
    return {
        "prefixes": [
            list(pair) for pair in Qwen2_5_VLForConditionalGeneration.hf_to_vllm_mapper.orig_to_new_prefix.items()
        ],
        "vision_stacked": {part: list(target) for part, target in stacked.items()},
    }


def run_case(case: dict) -> dict:
    from safetensors.torch import load_file

    from colossal_rl.config import VllmEngineConfig
    from colossal_rl.rollout.vllm_backend import VllmBackend

    started = time.perf_counter()
    try:
        engine = VllmEngineConfig(max_model_len=128, block_size=case.get("block_size"))
        backend = VllmBackend(case["model"], seed=0, dtype="float32", engine=engine,
                              tensor_parallel_size=case.get("tensor_parallel_size", 1))  # fmt: skip
    except Exception as error:  # what a user would see: the one line the backend raises
        return {"start_error": str(error), "start_s": time.perf_counter() - started}
    from colossal_rl.data import encode_prompt

    prompts, vision, images = case.get("prompts"), None, None
    if case.get("vision_rows"):
        prompts, vision, images = vision_prompts(backend, case)
    result = {"start_s": time.perf_counter() - started, "prompts": prompts}
    result["before"] = generate_all(backend, case, prompts, vision, images)
    if case.get("episodes"):
        result["episodes"] = multi_turn_episodes(backend, case)
    # What the producer feeds the engine and scores: its tokenizer here runs on transformers 5.
    result["encoded"] = [encode_prompt(backend.tokenizer, messages) for messages in case.get("messages", [])]
    result["decoded"] = backend.tokenizer.batch_decode(case.get("decode", []), skip_special_tokens=True)
    if case.get("continuous_max_new_tokens"):
        started = time.perf_counter()
        result["continuous"] = continuous_batching(backend, case, prompts)
        result["continuous_s"] = time.perf_counter() - started
    if case.get("weights"):
        weights = load_file(case["weights"])
        started = time.perf_counter()
        service = None
        if case.get("partial_weights"):  # version 1 through the producer, then `weights` as version 2 by the workers
            result["partial"] = partial_rollouts(backend, case, prompts, [load_file(case["partial_weights"]), weights])
        elif case.get("receive") == "workers":
            receive_in_workers(backend, weights, case.get("tensor_parallel_size", 1))
        elif case.get("continuous_max_new_tokens"):
            service, result["continuous_load"] = load_at_a_safe_point(backend, case, prompts, weights)
        else:
            backend.load_weights(weights)
        result["load_s"] = time.perf_counter() - started
        if service is None:
            result["after"] = generate_all(backend, case, prompts, vision, images)
        else:  # an evaluation's generate with decoding paused: beside the batcher's requests (run_apart)
            with service.exclusive():
                result["after"] = generate_all(backend, case, prompts, vision, images)
            service.close()
        try:
            backend.named_weights()
            result["read_back"] = "read"
        except Exception as error:
            result["read_back"] = str(error)
        if case.get("language_only_weights"):  # a frozen vision tower's sync: the tower's weights left out
            backend.load_weights(load_file(case["language_only_weights"]))
            result["after_language_only"] = generate_all(backend, case, prompts, vision, images)
        if case.get("lora_names"):
            base = backend.base_weights(set(case["lora_names"]))
            result["lora_base_names"] = sorted(base)
        if case.get("workers_weights"):  # a second sync, received by the engine's workers themselves
            receive_in_workers(backend, load_file(case["workers_weights"]), case["tensor_parallel_size"], version=2)
            result["after_workers"] = generate_all(backend, case, prompts, vision, images)
    if case.get("vision_rows"):
        result["mappers"] = qwen2_5_vl_mappers()
    backend.close()
    return result


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as handle:
        request = json.load(handle)
    results = {case["name"]: run_case(case) for case in request["cases"]}
    with open(result_path, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":  # vLLM's engine core is spawned: the work must not run on import
    sys.exit(main(sys.argv[1], sys.argv[2]))
