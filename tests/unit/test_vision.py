"""Vision-language policies on a random-weight tiny Qwen2.5-VL (``vision_fixtures.py``): image prompts, their
multimodal rotary positions against the model's own ``get_rope_index``, generation, the trainer's log-probs
against a plain Hugging Face forward with the same images (every sequence layout), the frozen tower."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from trainer_harness import make_config, make_trainer
from vision_fixtures import build_random_vlm, write_image_rows

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import replace
from colossal_rl.config_resolve import resolve
from colossal_rl.data import DataError, ImagePrompting, load_prompt_dataset
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.transformers_backend import TransformersBackend
from colossal_rl.vision.prompts import ImageDataError, row_images, with_image_parts
from colossal_rl.vision.rope import RopeTokens, padded_positions, sequence_positions

GROUP = 4
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_random_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def backend(vlm_dir):
    return TransformersBackend(str(vlm_dir))


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory):
    return write_image_rows(tmp_path_factory.mktemp("rows") / "train.jsonl", [1, 2, 3, 4])


def load(path, backend, **kwargs):
    prompting = ImagePrompting(processor=backend.processor, **kwargs)
    return load_prompt_dataset(path, backend.tokenizer, "Count.", 512, None, prompting)


# ------------------------------------------------------------------ prompts and placeholders
def test_markers_become_image_parts_in_place_and_prompts_without_markers_open_with_their_images():
    marked = with_image_parts([{"role": "user", "content": "A<image>B<image>"}], 2, "row 1")
    assert marked[0]["content"] == [
        {"type": "text", "text": "A"},
        {"type": "image"},
        {"type": "text", "text": "B"},
        {"type": "image"},
    ]
    unmarked = with_image_parts([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], 1, "row 1")
    assert unmarked[0]["content"] == [{"type": "text", "text": "S"}]
    assert unmarked[1]["content"] == [{"type": "image"}, {"type": "text", "text": "Q"}]
    with pytest.raises(ImageDataError, match="row 7: the prompt has 2 <image> markers but 1 images"):
        with_image_parts([{"role": "user", "content": "<image><image>"}], 1, "row 7")


def test_each_image_expands_to_one_token_per_merged_patch(backend, image_rows):
    dataset = load(image_rows, backend)
    image_token = backend.model.config.image_token_id
    for index in range(len(dataset)):
        vision = dataset.vision_inputs(index)
        tokens = torch.tensor(dataset.prompt_ids[index])
        assert vision.image_grid_thw.tolist() == [[1, 4, 4]]  # 56 x 56 pixels, 14-pixel patches
        assert int((tokens == image_token).sum()) == 4  # 16 patches, merged 2 x 2
        assert vision.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    text = backend.tokenizer.decode(dataset.prompt_ids[0])
    assert text.startswith("<|system|>Count.<|user|><|vision_start|><|image_pad|>")
    assert text.endswith("<|vision_end|>How many?<|assistant|>")


def test_max_pixels_bounds_the_image_tokens(backend, image_rows):
    dataset = load(image_rows, backend, min_pixels=112 * 112, max_pixels=112 * 112)
    assert dataset.vision_inputs(0).image_grid_thw.tolist() == [[1, 8, 8]]
    assert int((torch.tensor(dataset.prompt_ids[0]) == backend.model.config.image_token_id).sum()) == 16


def test_rows_over_the_image_limit_are_left_out_and_counted(backend, tmp_path):
    path = write_image_rows(tmp_path / "rows.jsonl", [1, 2])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["images"] = rows[1]["images"] * 2
    rows[1]["messages"]["content"] = "<image><image>How many?"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = load(path, backend, limit_images=1)
    assert (len(dataset), dataset.dropped_too_many_images) == (1, 1)
    assert len(load(path, backend).vision_inputs(1).image_grid_thw) == 2
    with pytest.raises(DataError, match="1 of 2 have more than --limit-images = 1 images, the other 1 are longer"):
        prompting = ImagePrompting(processor=backend.processor, limit_images=1)
        load_prompt_dataset(path, backend.tokenizer, "Count.", 10, None, prompting)


def test_a_missing_image_is_an_error_naming_the_file_and_row(backend, tmp_path):
    path = write_image_rows(tmp_path / "rows.jsonl", [1, 2])
    (tmp_path / "images" / "1.png").unlink()
    with pytest.raises(ImageDataError, match=r"rows.jsonl row 2, images\[0\]: cannot read image images/1.png"):
        load(path, backend)
    with pytest.raises(ImageDataError, match="must be a path"):
        row_images({"images": [3]}, "images", tmp_path, "row 1")


# ------------------------------------------------------------------ rotary positions
def test_positions_equal_the_models_get_rope_index(backend, tmp_path):
    model, tokens = backend.model, RopeTokens.of(backend.model.config)
    wide = write_image_rows(tmp_path / "wide.jsonl", [1, 2], size=(112, 56))
    dataset = load(wide, backend, min_pixels=56 * 112, max_pixels=56 * 112)  # a 4 x 8 grid: h != w
    first, second = dataset.vision_inputs(0), dataset.vision_inputs(1)
    text = backend.tokenizer("Hi<|vision_start|>", add_special_tokens=False)["input_ids"]
    # two images with text between and after: [text, image 1, text, image 2, text]
    pads = lambda v: [tokens.image_token_id] * int(v.image_grid_thw.prod() // 4)  # noqa: E731
    end = backend.tokenizer("<|vision_end|>ok", add_special_tokens=False)["input_ids"]
    two_images = torch.tensor(text + pads(first) + end + text + pads(second) + end)
    grids = torch.cat([first.image_grid_thw, second.image_grid_thw])
    assert first.image_grid_thw.tolist() == [[1, 4, 8]]
    theirs, _ = model.get_rope_index(two_images[None], grids)
    assert torch.equal(sequence_positions(two_images, grids, tokens), theirs[:, 0])
    # left-padded rows of unequal length, one without images
    ids = [
        dataset.prompt_ids[0],
        dataset.prompt_ids[1][5:],
        backend.tokenizer("plain text", add_special_tokens=False)["input_ids"],
    ]
    width = max(map(len, ids))
    input_ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, width - len(seq) :], mask[row, width - len(seq) :] = torch.tensor(seq), 1
    row_grids = [first.image_grid_thw, None, None]
    input_ids[1] = torch.where(input_ids[1] == tokens.image_token_id, 0, input_ids[1])  # row 2: text only
    theirs, _ = model.get_rope_index(input_ids, first.image_grid_thw, attention_mask=mask)
    assert torch.equal(padded_positions(input_ids, mask, row_grids, tokens), theirs)


# ------------------------------------------------------------------ generation and the trainer's log-probs
def rollout(backend, dataset, rows: list[int]) -> RolloutBatch:
    torch.manual_seed(0)
    vision = [dataset.vision_inputs(i) for i in rows]
    sampling = SamplingSettings(temperature=TEMPERATURE, max_new_tokens=6)
    out = backend.generate([dataset.prompt_ids[i] for i in rows], GROUP, sampling, vision)
    n = out.prompt_ids.shape[0]
    return RolloutBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        response_ids=out.response_ids,
        response_mask=out.response_mask,
        behaviour_logprobs=out.behaviour_logprobs,
        rewards=torch.arange(n, dtype=torch.float32) % 2,
        answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n),
        truncated=out.truncated,
        advantages=torch.linspace(-1, 1, n),
        group_size=GROUP,
        policy_version=0,
        vision=tuple(v for v in vision for _ in range(GROUP)),
    )


def reference_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """Each sample alone, unpadded, through the plain HF forward (positions from the model's get_rope_index)."""
    result = torch.zeros(batch.response_ids.shape)
    with torch.no_grad():
        for s in range(batch.num_samples):
            prompt = batch.prompt_ids[s][batch.prompt_mask[s].bool()]
            length = int(batch.response_mask[s].sum())
            response = batch.response_ids[s, :length]
            ids = torch.cat([prompt, response])[None]
            vision = batch.vision[s]
            logits = model(
                input_ids=ids, pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw
            ).logits[0, len(prompt) - 1 : -1]
            result[s, :length] = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, response[:, None])[:, 0]
    return result


def without_generated_image_tokens(batch: RolloutBatch, image_token_id: int, replacement: int) -> RolloutBatch:
    """The batch with any image token a (random) policy generated replaced by a text token: Hugging Face's own
    forward cannot take image tokens beyond the images' (it fails), so the plain reference needs none."""
    from dataclasses import replace as dataclass_replace

    response_ids = batch.response_ids.masked_fill(batch.response_ids == image_token_id, replacement)
    return dataclass_replace(batch, response_ids=response_ids)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_trainer_logprobs_equal_a_plain_forward_with_the_same_images(vlm_dir, backend, image_rows, layout):
    sampled = rollout(backend, load(image_rows, backend), [0, 2, 3])
    assert int(sampled.response_mask.sum()) > 2 * sampled.num_samples  # responses of some length
    image_token = backend.model.config.image_token_id
    batch = without_generated_image_tokens(sampled, image_token, backend.tokenizer.convert_tokens_to_ids("a"))
    config = make_config(train={"sequence_layout": layout, "microbatch_size": 8}, temperature=TEMPERATURE)
    config = replace(config, model=replace(config.model, path=str(vlm_dir)))
    trainer = make_trainer(config, device="cpu")
    expected = reference_logprobs(backend.model, batch)
    got = trainer.logprobs_no_grad(trainer.model, batch)
    torch.testing.assert_close(got * batch.response_mask, expected, atol=1e-5, rtol=1e-5)
    # The producer's incremental decoding (cache, positions continuing past the image, generated image tokens
    # embedded as tokens) gave the log-probs the trainer gives the batch as sampled.
    as_sampled = trainer.logprobs_no_grad(trainer.model, sampled) * sampled.response_mask
    torch.testing.assert_close(sampled.behaviour_logprobs, as_sampled, atol=1e-4, rtol=1e-4)


def test_a_response_with_an_image_token_is_embedded_as_a_token(vlm_dir, backend, image_rows):
    """A policy may generate ``<|image_pad|>``: training on it neither fails nor gives it image features."""
    batch = rollout(backend, load(image_rows, backend), [0])
    image_token = backend.model.config.image_token_id
    from dataclasses import replace as dataclass_replace

    forced = dataclass_replace(batch, response_ids=batch.response_ids.clone())
    forced.response_ids[0, 0] = image_token
    forced.response_mask[0, :2] = 1
    config = make_config(train={"sequence_layout": "packed", "microbatch_size": 8}, temperature=TEMPERATURE)
    trainer = make_trainer(replace(config, model=replace(config.model, path=str(vlm_dir))), device="cpu")
    got = trainer.logprobs_no_grad(trainer.model, forced)
    # by hand: the embedding of the token itself, as decoding feeds it
    prompt = forced.prompt_ids[0][forced.prompt_mask[0].bool()]
    vision = forced.vision[0]
    with torch.no_grad():
        out = backend.model(
            input_ids=prompt[None],
            pixel_values=vision.pixel_values,
            image_grid_thw=vision.image_grid_thw,
            use_cache=True,
        )
        first = torch.log_softmax(out.logits[0, -1] / TEMPERATURE, -1)[image_token]
        cache_position = torch.tensor([len(prompt)])
        step = backend.model(
            input_ids=torch.tensor([[image_token]]), past_key_values=out.past_key_values, cache_position=cache_position
        )
        second = torch.log_softmax(step.logits[0, -1] / TEMPERATURE, -1)[forced.response_ids[0, 1]]
    torch.testing.assert_close(got[0, :2], torch.stack([first, second]), atol=1e-5, rtol=1e-5)


def test_a_groups_pixels_are_pickled_once(backend, image_rows):
    batch = rollout(backend, load(image_rows, backend), [0, 1])
    pixel_bytes = batch.vision[0].pixel_values.numel() * 4
    text_only = pickle.dumps(replace_vision(batch, ()))
    assert len(pickle.dumps(batch)) - len(text_only) < 2.2 * pixel_bytes  # two groups, not 2 x GROUP copies
    assert pickle.loads(pickle.dumps(batch)).select_groups([1]).vision[0].image_grid_thw.tolist() == [[1, 4, 4]]


def replace_vision(batch, vision):
    from dataclasses import replace as dataclass_replace

    return dataclass_replace(batch, vision=vision)


# ------------------------------------------------------------------ the frozen vision tower
@pytest.mark.parametrize("freeze", [True, False])
def test_a_frozen_tower_gets_no_gradient_and_is_not_synced(vlm_dir, backend, image_rows, freeze):
    batch = rollout(backend, load(image_rows, backend), [0, 1])
    config = make_config(train={"freeze_vision_tower": freeze, "microbatch_size": 8, "learning_rate": 1e-2})
    config = replace(config, model=replace(config.model, path=str(vlm_dir)))
    trainer = make_trainer(config, device="cpu")
    before = {name: p.detach().clone() for name, p in trainer.engine.unwrapped().named_parameters()}
    trainer.train_step(batch)
    after = dict(trainer.engine.unwrapped().named_parameters())
    tower = [name for name in before if name.startswith("visual.")]
    language = [name for name in before if name.startswith("model.layers.")]
    assert tower and language
    assert all(not torch.equal(before[n], after[n]) for n in language if n.endswith("q_proj.weight"))
    tower_changed = [n for n in tower if not torch.equal(before[n], after[n])]
    synced = trainer.stage_state_dict()
    if freeze:
        assert tower_changed == [] and all(after[n].grad is None and not after[n].requires_grad for n in tower)
        assert not any(name.startswith("visual.") for name in synced)
    else:
        assert tower_changed
        assert set(tower) <= set(synced)
    assert any(name.startswith("model.layers.") for name in synced)


# ------------------------------------------------------------------ checks before Ray starts
def vision_config(vlm_dir, rows, **parallel):
    from colossal_rl.config import RLConfig

    config = RLConfig()
    return replace(
        config,
        model=replace(config.model, path=str(vlm_dir)),
        data=replace(config.data, train_path=str(rows), eval_paths=()),
        parallel=replace(config.parallel, **parallel),
    )


def test_input_checks_refuse_what_cannot_train_naming_it(vlm_dir, image_rows, tmp_path):
    from colossal_rl.config import EMBEDDED_MODEL_DIR
    from colossal_rl.input_checks import InputError, check_inputs

    assert check_inputs(vision_config(vlm_dir, image_rows)).train_rows == 4
    with pytest.raises(InputError, match="vision-language model: it trains under DDP and ZeRO only"):
        check_inputs(vision_config(vlm_dir, image_rows, tp_size=2))
    streamed = vision_config(vlm_dir, image_rows)
    streamed = replace(
        streamed,
        schedule=replace(streamed.schedule, mode="stream"),
        generation=replace(streamed.generation, continuous_batching=True),
    )
    with pytest.raises(InputError, match="--continuous-batching: .* is a vision-language model"):
        check_inputs(streamed)
    text_model = vision_config(EMBEDDED_MODEL_DIR, image_rows)
    with pytest.raises(InputError, match=r"train.jsonl row 1 has images \(--image-key images\) but .* text-only"):
        check_inputs(text_model)
    frozen = replace(text_model, data=replace(text_model.data, train_path=str(tmp_path / "t.jsonl")))
    (tmp_path / "t.jsonl").write_text('{"messages": "1+1=?", "gt_answer": "2"}\n')
    frozen = replace(frozen, train=replace(frozen.train, freeze_vision_tower=True))
    with pytest.raises(InputError, match="--freeze-vision-tower: .* has no vision tower"):
        check_inputs(frozen)
    missing = write_image_rows(tmp_path / "m" / "rows.jsonl", [1, 2, 3])
    (missing.parent / "images" / "2.png").unlink()
    with pytest.raises(InputError, match=r"rows.jsonl row 3: images\[0\] 'images/2.png': no such image file"):
        check_inputs(vision_config(vlm_dir, missing))


# ------------------------------------------------------------------ a producer's round and evaluation
def test_a_producer_round_carries_each_groups_images_once_and_evaluates_with_them(vlm_dir, image_rows):
    from colossal_rl.reward import build_reward_scorer
    from colossal_rl.rollout.producer import Producer
    from colossal_rl.schedule.prompts import EpisodeSchedule

    config = vision_config(vlm_dir, image_rows)
    config = replace(
        config,
        data=replace(config.data, eval_paths=(("shapes", str(image_rows)),)),
        schedule=replace(config.schedule, inference_batch_size=2),
        generation=replace(config.generation, num_generations=3, microbatch_size=2, max_new_tokens=4),
        train=replace(config.train, batch_size=2, minibatch_size=2, microbatch_size=6),
    ).validate()
    producer = Producer(0, resolve(config), build_reward_scorer("boxed", timeout_s=5.0, num_workers=1))
    rows = EpisodeSchedule(len(producer.train_data), 1, 2, producer.config.data.seed).rows_for(0, 0)  # round 0
    batch = producer.produce_chunk(0, rows, seed_index=0).batch
    assert len(batch.vision) == batch.num_samples == 6
    for group in range(2):
        shared = {id(v) for v in batch.vision[group * 3 : group * 3 + 3]}
        assert len(shared) == 1  # one object per group: pickled, and sent, once
        row = batch.data_indices[group]
        expected = producer.train_data.vision_inputs(row)
        assert torch.equal(batch.vision[group * 3].pixel_values, expected.pixel_values)
    (result,) = producer.evaluate(num_producers=1)
    assert (result.task, result.num_prompts) == ("shapes", 4)
    assert all(record["status"] for record in result.records)


# ------------------------------------------------------------------ a second device (a GPU's mistakes, seen on CPU)
@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_a_vision_step_on_a_second_device_equals_the_host_run(vlm_dir, backend, image_rows, layout):
    """The pixels, grids, 3-axis positions and prompt-token masks follow the trainer's device in every layout
    (``fake_accelerator``: an operator mixing host and device tensors raises, as on a GPU), and the step computes
    what it computes on the host. The batch arrives on the host, as rollouts do from Ray."""
    from unittest import mock

    from colossalai.accelerator import get_accelerator
    from fake_accelerator import FAKE_DEVICE, FakeAccelerator, OnAccelerator

    batch = rollout(backend, load(image_rows, backend), [0, 2])
    config = make_config(
        train={"sequence_layout": layout, "microbatch_size": 8, "attn_implementation": "eager", "batch_size": 2},
        temperature=TEMPERATURE,
    )
    config = replace(config, model=replace(config.model, path=str(vlm_dir)))
    host = make_trainer(config, device="cpu")
    host_logprobs = host.logprobs_no_grad(host.model, batch)
    host_metrics = host.train_step(batch)

    accelerator = type(get_accelerator())
    with mock.patch.object(accelerator, "get_current_device", lambda self: FAKE_DEVICE), FakeAccelerator():
        trainer = make_trainer(config)
        assert trainer.device == FAKE_DEVICE
        assert all(isinstance(p, OnAccelerator) for p in trainer.model.parameters())
        logprobs = trainer.logprobs_no_grad(trainer.model, batch).cpu()
        metrics = trainer.train_step(batch)
    torch.testing.assert_close(logprobs, host_logprobs, atol=1e-6, rtol=1e-6)
    for name, value in host_metrics.items():
        if not name.startswith("time/"):
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


# ------------------------------------------------------------------ LoRA on a vision-language model
def test_lora_all_linear_adapts_the_language_model_only_and_its_adapter_dir_says_so(vlm_dir, tmp_path):
    """``--lora-target-modules all-linear`` (the default) puts adapters on the language model's linear layers,
    not the vision tower's (peft's own ``all-linear`` would take both); naming tower modules adapts them; the
    written adapter directory lists exactly the adapted modules, so peft loads it onto the base as trained."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from colossal_rl.config import TrainConfig
    from colossal_rl.lora_weights import adapter_state_dict
    from colossal_rl.training.lora import add_lora_adapters, write_adapter_dir

    def load():
        return AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()

    plain = load()
    language_linears = {
        name
        for name, module in plain.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.startswith("visual.") and name != "lm_head"
    }
    model = add_lora_adapters(load(), TrainConfig(lora_rank=4))
    adapters = adapter_state_dict(model.state_dict())
    assert {name.rsplit(".lora_", 1)[0] for name in adapters} == language_linears
    tower = add_lora_adapters(load(), TrainConfig(lora_rank=4, lora_target_modules="qkv"))
    tower_adapted = {name.rsplit(".lora_", 1)[0] for name in adapter_state_dict(tower.state_dict())}
    assert tower_adapted and all(name.startswith("visual.") for name in tower_adapted)

    torch.manual_seed(0)
    trained = {name: torch.randn_like(t) * 0.1 for name, t in adapters.items()}  # B != 0: the adapters matter
    write_adapter_dir(trained, TrainConfig(lora_rank=4), str(vlm_dir), tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load(), tmp_path / "adapter")
    loaded_adapters = {name for name, _ in loaded.named_parameters() if ".lora_" in name}
    assert not any(".visual." in name for name in loaded_adapters)
    assert len(loaded_adapters) == len(trained)


def test_a_lora_trainer_on_a_vlm_trains_and_syncs_language_adapters_only(vlm_dir, backend, image_rows):
    batch = rollout(backend, load(image_rows, backend), [0, 1])
    config = make_config(train={"lora_rank": 4, "microbatch_size": 8, "learning_rate": 1e-2})
    config = replace(config, model=replace(config.model, path=str(vlm_dir)))
    trainer = make_trainer(config, device="cpu")
    metrics = trainer.train_step(batch)
    assert metrics["train/grad_norm"] > 0
    synced = trainer.stage_state_dict()
    assert synced and all(".lora_" in name and not name.startswith("visual.") for name in synced)
