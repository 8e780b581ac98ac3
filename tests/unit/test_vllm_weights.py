"""Weight names from the trainer's Hugging Face state dict to vLLM's Qwen2/Llama models, the way back (for
checks), the worker-side loader's checks and its in-place reload, tensors across vLLM's RPC, and LoRA's base weights
read from the checkpoint — all without vLLM (``tests/vllm_engine`` runs the real engine).

``vllm_073_parameter_names`` writes down, from vLLM 0.7.3's vllm/model_executor/models/qwen2.py and llama.py,
which parameters those models hold: fused ``qkv_proj`` (bias in Qwen2 only) and ``gate_up_proj``, no
``lm_head`` parameter of its own when embeddings are tied (unchanged in vLLM 0.32).
``vllm_032_qwen2_5_vl_parameter_names`` does the same for Qwen2.5-VL from vLLM 0.32's qwen2_5_vl.py: the vision
tower under ``visual.`` with its MLP's gate/up fused into ``gate_up_proj`` (0.7.3 kept them apart), the Qwen2
language model under ``language_model.``; ``tests/vllm_engine`` checks the list against the real engine's."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
)

from colossal_rl.rollout.vllm_weights import (
    SUPPORTED_ARCHITECTURES,
    checkpoint_weights,
    from_vllm_weights,
    hf_name_of_vllm,
    known_architecture,
    load_weights_on_worker,
    omissible_prefixes,
    pack_tensors,
    refresh_kept_cpu_kernels,
    strip_wrapper_prefix,
    to_vllm_weights,
    unpack_tensors,
    vllm_parameter_name,
)
from colossal_rl.vision.models import without_vision_tower

VL = "Qwen2_5_VLForConditionalGeneration"
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: embedding rows are padded to a multiple of this


def tiny_config(kind: str, tied: bool):
    common = dict(
        vocab_size=102, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return Qwen2Config(**common) if kind == "qwen2" else LlamaConfig(**common)


def hf_state_dict(config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return dict(AutoModelForCausalLM.from_config(config).state_dict())


def vllm_073_parameter_names(config, qkv_bias: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        names |= {
            f"{prefix}.self_attn.qkv_proj.weight",
            f"{prefix}.self_attn.o_proj.weight",
            f"{prefix}.mlp.gate_up_proj.weight",
            f"{prefix}.mlp.down_proj.weight",
            f"{prefix}.input_layernorm.weight",
            f"{prefix}.post_attention_layernorm.weight",
        }
        if qkv_bias:
            names.add(f"{prefix}.self_attn.qkv_proj.bias")
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


def tiny_vl_config(tied: bool) -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        vocab_size=102, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        architectures=[VL],
    )  # fmt: skip


def hf_vl_state_dict(config) -> dict[str, torch.Tensor]:
    """transformers 4.51's Qwen2.5-VL state dict: ``visual.*``, ``model.*``, ``lm_head.weight``."""
    torch.manual_seed(0)
    return dict(Qwen2_5_VLForConditionalGeneration(config).state_dict())


def vllm_032_qwen2_5_vl_parameter_names(config) -> set[str]:
    """vLLM 0.32's Qwen2_5_VLForConditionalGeneration parameters: ``visual`` (Qwen2_5_VisionTransformer: patch
    embedding, blocks with RMS norms, ``attn.qkv``/``attn.proj`` and an MLP of ``gate_up_proj``/``down_proj``, all
    with biases, the merger) and ``language_model`` (a Qwen2ForCausalLM)."""
    names = {"visual.patch_embed.proj.weight", "visual.merger.ln_q.weight"}
    names |= {f"visual.merger.mlp.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")}
    for block in range(config.vision_config.depth):
        prefix = f"visual.blocks.{block}"
        names |= {f"{prefix}.norm1.weight", f"{prefix}.norm2.weight"}
        for module in ("attn.qkv", "attn.proj", "mlp.gate_up_proj", "mlp.down_proj"):
            names |= {f"{prefix}.{module}.weight", f"{prefix}.{module}.bias"}
    names |= {f"language_model.{name}" for name in vllm_073_parameter_names(config, qkv_bias=True)}
    return names


def fuse_like_vllm(state: dict[str, torch.Tensor], config, architecture: str | None = None) -> dict[str, torch.Tensor]:
    """What one unsharded vLLM worker holds after loading ``state`` (what its weight loaders build)."""
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in to_vllm_weights(state, tie_word_embeddings=config.tie_word_embeddings):
        target = vllm_parameter_name(name, architecture)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = -(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
            tensor = torch.cat([tensor, torch.zeros(rows - tensor.shape[0], tensor.shape[1])])
        fused[target] = torch.cat([fused[target], tensor]) if target in fused else tensor
    return fused


@pytest.mark.parametrize(("kind", "qkv_bias"), [("qwen2", True), ("llama", False)])
@pytest.mark.parametrize("tied", [True, False])
def test_every_trainer_weight_lands_in_a_vllm_parameter_and_every_parameter_is_filled(kind, qkv_bias, tied):
    config = tiny_config(kind, tied)
    state = hf_state_dict(config)
    weights = to_vllm_weights(state, tie_word_embeddings=tied)
    names = [name for name, _ in weights]
    assert ("lm_head.weight" in names) == (not tied)
    assert {vllm_parameter_name(name) for name in names} == vllm_073_parameter_names(config, qkv_bias)
    # Names pass through unchanged (vLLM fuses them itself), in the state dict's order, tensors not copied.
    assert names == [name for name in state if not (tied and name == "lm_head.weight")]
    assert all(tensor is state[name] for name, tensor in weights)


def test_stacked_names_follow_vllm_tables():
    assert vllm_parameter_name("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj.bias"
    assert vllm_parameter_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert vllm_parameter_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert vllm_parameter_name("model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("module.model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
        ("model.module.model.norm.weight", "model.norm.weight"),
        ("module._orig_mod.lm_head.weight", "lm_head.weight"),
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    ],
)
def test_wrapper_prefixes_are_stripped(raw, clean):
    assert strip_wrapper_prefix(raw) == clean


def test_rotary_buffers_and_tied_output_are_not_sent_and_collisions_are_refused():
    tensor = torch.zeros(2)
    state = {
        "module.model.layers.0.self_attn.rotary_emb.inv_freq": tensor,
        "module.lm_head.weight": tensor,
        "module.model.norm.weight": tensor,
    }
    assert [n for n, _ in to_vllm_weights(state, tie_word_embeddings=True)] == ["model.norm.weight"]
    assert [n for n, _ in to_vllm_weights(state, tie_word_embeddings=False)] == ["lm_head.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match="two weights map to 'model.norm.weight'"):
        to_vllm_weights({"module.model.norm.weight": tensor, "model.norm.weight": tensor}, tie_word_embeddings=True)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_reading_vllm_weights_back_gives_the_trainer_state_dict(kind, tied):
    config = tiny_config(kind, tied)
    state = hf_state_dict(config)
    back = from_vllm_weights(fuse_like_vllm(state, config), config)
    assert set(back) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)


# --- the loader that runs inside each vLLM worker ------------------------------------------------------------


class FakeVllmModel:
    """Stands for a vLLM model: its parameter names and a ``load_weights`` returning what it loaded."""

    def __init__(self, parameter_names: set[str], loads_all: bool = True, architecture: str | None = None):
        self.parameter_names = parameter_names
        self.loads_all = loads_all
        self.architecture = architecture
        self.received: list[str] = []

    def named_parameters(self):
        return [(name, torch.zeros(1)) for name in sorted(self.parameter_names)]

    def load_weights(self, weights):
        self.received = [name for name, _ in weights]
        loaded = {vllm_parameter_name(name, self.architecture) for name in self.received}
        return loaded if self.loads_all else set(sorted(loaded)[1:])


class FakeWorker:
    def __init__(self, model):
        self.model_runner = type("ModelRunner", (), {"model": model})()


def test_worker_loader_reports_nothing_missing_for_a_full_update():
    config = tiny_config("qwen2", tied=True)
    weights = to_vllm_weights(hf_state_dict(config), tie_word_embeddings=True)
    model = FakeVllmModel(vllm_073_parameter_names(config, qkv_bias=True))
    assert load_weights_on_worker(FakeWorker(model), weights) == []
    assert model.received == [name for name, _ in weights]


def test_worker_loader_names_unknown_and_unreached_parameters():
    config = tiny_config("qwen2", tied=True)
    weights = to_vllm_weights(hf_state_dict(config), tie_word_embeddings=True)
    parameters = vllm_073_parameter_names(config, qkv_bias=True)
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_weights_on_worker(FakeWorker(FakeVllmModel(parameters)), weights + [("lm_head.weight", torch.zeros(1))])
    missing = load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, loads_all=False)), weights)
    assert missing == [sorted(parameters)[0]]


class FusedGateUp:
    """Stands for a worker's ``CheckpointFormat`` under transformers 5: splits one fused in-memory name back into the
    checkpoint's two; ``usable``: False stands for a worker where building it fails (transformers' meta model inside
    vLLM's Transformers backend), so it must not be called when nothing needs reverting."""

    def __init__(self, fused: str, parts: tuple[str, str], usable: bool = True):
        self.fused, self.parts, self.usable, self.calls = fused, parts, usable, 0

    def __call__(self, named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls += 1
        assert self.usable, "the checkpoint-format revert was used for names the worker holds"
        reverted = {}
        for name, tensor in named_tensors.items():
            reverted.update(zip(self.parts, tensor.chunk(2), strict=True) if name == self.fused else [(name, tensor)])
        return reverted


def test_a_worker_reverts_to_checkpoint_names_only_names_it_does_not_hold():
    """A ColossalAI trainer's sync is in checkpoint names: loaded as sent, the revert never called. An fsdp2 trainer
    on transformers 5 sends fused names: reverted to the checkpoint's, then loaded, every parameter reached."""
    config = tiny_config("qwen2", tied=True)
    weights = to_vllm_weights(hf_state_dict(config), tie_word_embeddings=True)
    parameters = vllm_073_parameter_names(config, qkv_bias=True)
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    fused = "model.layers.0.mlp.gate_up_fused"
    worker = FakeWorker(FakeVllmModel(parameters))
    worker._colossal_rl_checkpoint_format = FusedGateUp(fused, (gate, up), usable=False)
    assert load_weights_on_worker(worker, weights) == []

    by_name = dict(weights)
    sent = [(name, tensor) for name, tensor in weights if name not in (gate, up)]
    sent.append((fused, torch.cat([by_name[gate], by_name[up]])))
    model = FakeVllmModel(parameters)
    worker = FakeWorker(model)
    worker._colossal_rl_checkpoint_format = FusedGateUp(fused, (gate, up))
    assert load_weights_on_worker(worker, sent) == []
    assert worker._colossal_rl_checkpoint_format.calls == 1
    assert sorted(model.received) == sorted(name for name, _ in weights)


# --- Qwen2.5-VL ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_vision_language_weights_land_in_vllm_qwen2_5_vl_parameters(tied):
    config = tiny_vl_config(tied)
    state = hf_vl_state_dict(config)
    weights = to_vllm_weights(state, tie_word_embeddings=tied)
    assert [name for name, _ in weights] == [name for name in state if not (tied and name == "lm_head.weight")]
    targets = {name: vllm_parameter_name(name, VL) for name, _ in weights}
    assert set(targets.values()) == vllm_032_qwen2_5_vl_parameter_names(config)
    # The prefix mapper, the language model's fusion, the tower's MLP fused by its own loader, its qkv kept.
    assert targets["model.layers.1.self_attn.k_proj.bias"] == "language_model.model.layers.1.self_attn.qkv_proj.bias"
    assert targets["model.layers.0.mlp.up_proj.weight"] == "language_model.model.layers.0.mlp.gate_up_proj.weight"
    assert targets["visual.blocks.0.mlp.gate_proj.weight"] == "visual.blocks.0.mlp.gate_up_proj.weight"
    assert targets["visual.blocks.0.mlp.up_proj.bias"] == "visual.blocks.0.mlp.gate_up_proj.bias"
    assert targets["visual.blocks.0.mlp.down_proj.weight"] == "visual.blocks.0.mlp.down_proj.weight"
    assert targets["visual.blocks.1.attn.qkv.bias"] == "visual.blocks.1.attn.qkv.bias"
    if not tied:
        assert targets["lm_head.weight"] == "language_model.lm_head.weight"


def test_architecture_names_and_the_way_back():
    assert VL in SUPPORTED_ARCHITECTURES
    assert (
        known_architecture(["Foo", VL]) == VL
        and known_architecture(["Foo"]) is None
        and known_architecture(None) is None
    )
    assert vllm_parameter_name("model.norm.weight", None) == "model.norm.weight"  # a text model: no prefix
    assert hf_name_of_vllm("language_model.lm_head.weight", VL) == "lm_head.weight"
    assert hf_name_of_vllm("language_model.model.norm.weight", VL) == "model.norm.weight"
    assert hf_name_of_vllm("visual.merger.mlp.0.bias", VL) == "visual.merger.mlp.0.bias"
    assert hf_name_of_vllm("model.norm.weight", "Qwen2ForCausalLM") == "model.norm.weight"
    assert omissible_prefixes(VL) == ("visual.",) and omissible_prefixes("Qwen2ForCausalLM") == ()


def test_transformers_452_checkpoint_names_map_like_vllms_mapper():
    """transformers >= 4.52 saves Qwen2.5-VL as ``model.language_model.*`` / ``model.visual.*``: vLLM 0.32's mapper
    takes those first, so they land in the same parameters as 4.51's names."""
    assert vllm_parameter_name("model.language_model.layers.0.mlp.up_proj.weight", VL) == (
        "language_model.model.layers.0.mlp.gate_up_proj.weight"
    )
    assert (
        vllm_parameter_name("model.visual.blocks.0.mlp.gate_proj.bias", VL) == "visual.blocks.0.mlp.gate_up_proj.bias"
    )
    assert vllm_parameter_name("model.visual.merger.ln_q.weight", VL) == "visual.merger.ln_q.weight"
    assert vllm_parameter_name("model.norm.weight", VL) == "language_model.model.norm.weight"


@pytest.mark.parametrize("tied", [True, False])
def test_reading_vision_language_weights_back_gives_the_trainer_state_dict(tied):
    config = tiny_vl_config(tied)
    state = hf_vl_state_dict(config)
    held = fuse_like_vllm(state, config, VL)
    assert set(held) == vllm_032_qwen2_5_vl_parameter_names(config)
    back = from_vllm_weights(held, config)
    assert set(back) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)


def test_a_sync_without_the_frozen_vision_tower_loads_and_reaches_everything_else():
    config = tiny_vl_config(tied=True)
    state = hf_vl_state_dict(config)
    parameters = vllm_032_qwen2_5_vl_parameter_names(config)
    full = to_vllm_weights(state, tie_word_embeddings=True)
    assert load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, architecture=VL)), full, VL, ("visual.",)) == []

    without_tower = to_vllm_weights(without_vision_tower(state), tie_word_embeddings=True)
    assert not any(name.startswith("visual.") for name, _ in without_tower)
    model = FakeVllmModel(parameters, architecture=VL)
    assert load_weights_on_worker(FakeWorker(model), without_tower, VL, omissible_prefixes(VL)) == []
    assert model.received == [name for name, _ in without_tower]
    # Not omissible: the tower counts as not reached; a tower sent in part is reported whatever the setting.
    missing = load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, architecture=VL)), without_tower, VL)
    assert missing == sorted(name for name in parameters if name.startswith("visual."))
    partial = without_tower + [(n, t) for n, t in full if n == "visual.merger.ln_q.weight"]
    missing = load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, architecture=VL)), partial, VL, ("visual.",))
    assert "visual.patch_embed.proj.weight" in missing and "visual.merger.ln_q.weight" not in missing
    with pytest.raises(KeyError, match="visual.blocks.9.norm1.weight"):
        load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, architecture=VL)),
                               [("visual.blocks.9.norm1.weight", torch.zeros(1))], VL, ("visual.",))  # fmt: skip


def test_a_lora_sync_of_merged_layers_only_is_partial_on_purpose_but_unknown_names_still_fail():
    """With LoRA the producer sends only the layers the adapters changed (merged): nothing else is expected."""
    config = tiny_vl_config(tied=True)
    state = hf_vl_state_dict(config)
    parameters = vllm_032_qwen2_5_vl_parameter_names(config)
    merged = {name: t for name, t in state.items() if name.endswith(("q_proj.weight", "v_proj.weight"))}
    weights = to_vllm_weights(merged, tie_word_embeddings=True)
    strict = load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, architecture=VL)), weights, VL)
    assert "language_model.model.norm.weight" in strict  # without the partial marker the rest counts as not reached
    model = FakeVllmModel(parameters, architecture=VL)
    assert load_weights_on_worker(FakeWorker(model), weights, VL, ("",)) == []
    assert model.received == [name for name, _ in weights]
    with pytest.raises(KeyError, match="no_such.weight"):
        load_weights_on_worker(FakeWorker(FakeVllmModel(parameters, architecture=VL)),
                               [("no_such.weight", torch.zeros(1))], VL, ("",))  # fmt: skip


# --- versions and routes ---------------------------------------------------------------------------------------


class ReloadingWorker(FakeWorker):
    """A vLLM V1 worker: it has ``reload_weights`` (the in-place reload that re-runs post-load processing)."""

    def __init__(self, model):
        super().__init__(model)
        self.reloads = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.reloads.append(([name for name, _ in weights_iterator], is_checkpoint_format))


def test_a_v1_worker_reloads_in_place_instead_of_loading_over_processed_weights():
    config = tiny_config("qwen2", tied=True)
    weights = to_vllm_weights(hf_state_dict(config), tie_word_embeddings=True)
    model = FakeVllmModel(vllm_073_parameter_names(config, qkv_bias=True))
    worker = ReloadingWorker(model)
    assert load_weights_on_worker(worker, weights) == []
    assert worker.reloads == [([name for name, _ in weights], True)]
    assert model.received == []  # never model.load_weights: the CPU backend emptied those parameters


class KeptKernelLayer(torch.nn.Module):
    """Shaped like vLLM's CPU embedding used as a tied output layer: a weight kept beside a kernel handle."""

    def __init__(self, numel: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(numel))
        self.cpu_linear = object()
        self.processed = 0
        layer = self

        class Method:
            def process_weights_after_loading(self, module):
                assert module is layer
                layer.processed += 1

        self.quant_method = Method()


def test_kept_cpu_kernels_are_rebuilt_after_a_reload_and_emptied_ones_are_not():
    model = torch.nn.Module()
    model.kept, model.emptied, model.plain = KeptKernelLayer(4), KeptKernelLayer(0), torch.nn.Linear(2, 2)
    assert refresh_kept_cpu_kernels(model) == 1
    assert (model.kept.processed, model.emptied.processed) == (1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_cross_the_rpc_as_bytes_and_come_back_equal(dtype):
    named = [
        ("a", torch.randn(3, 5).to(dtype)),
        ("b", torch.arange(4, dtype=dtype)),
        ("empty", torch.zeros(0, 2, dtype=dtype)),
    ]
    packed = pack_tensors(named)
    assert all(isinstance(raw, bytes) for *_, raw in packed)
    back = unpack_tensors(packed)
    assert [name for name, _ in back] == ["a", "b", "empty"]
    for (_, original), (_, copy) in zip(named, back, strict=True):
        assert copy.dtype == dtype and torch.equal(copy, original)


def test_lora_base_weights_come_from_the_checkpoint_with_a_tied_output_layer(tmp_path):
    from safetensors.torch import save_file

    embedding = torch.randn(6, 4)
    save_file({"model.embed_tokens.weight": embedding, "model.layers.0.q.weight": torch.ones(4, 4)},
              str(tmp_path / "model-00001-of-00002.safetensors"))  # fmt: skip
    save_file({"model.layers.1.q.weight": torch.zeros(4, 4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    base = checkpoint_weights(str(tmp_path), {"lm_head.weight", "model.layers.1.q.weight"})
    assert sorted(base) == ["lm_head.weight", "model.layers.1.q.weight"]
    assert torch.equal(base["lm_head.weight"], embedding) and torch.equal(
        base["model.layers.1.q.weight"], torch.zeros(4, 4)
    )
    with pytest.raises(KeyError, match="model.layers.9.q.weight"):
        checkpoint_weights(str(tmp_path), {"model.layers.9.q.weight"})


def test_views_into_shared_memory_cross_the_rpc_as_plain_bytes(tmp_path):
    """Issue 33 item 7: views into ``torch.from_file(shared=True)`` storage (``--weight-sync-mode shm``) failed to
    pickle through vLLM 0.7's worker queues; the V1 backend sends packed bytes, which pickle like any bytes."""
    import pickle

    region = torch.from_file(str(tmp_path / "region"), shared=True, size=64, dtype=torch.float32)
    region.copy_(torch.arange(64, dtype=torch.float32))
    views = [("a.weight", region[:48].view(6, 8)), ("b.weight", region[48:].view(4, 4))]
    packed = pickle.loads(pickle.dumps(pack_tensors(views)))
    for (name, original), (back_name, back) in zip(views, unpack_tensors(packed), strict=True):
        assert back_name == name and torch.equal(back, original)


def test_a_reload_rebuilds_the_kernels_of_kept_weights():
    """The real engine showed it (tests/vllm_engine): without the rebuild a tied output layer computes with the
    weights it was first loaded with."""
    model = torch.nn.Module()
    model.lm_head = KeptKernelLayer(4)
    worker = ReloadingWorker(model)
    assert load_weights_on_worker(worker, [("lm_head.weight", torch.zeros(4))]) == []
    assert worker.reloads == [(["lm_head.weight"], True)] and model.lm_head.processed == 1


def test_the_reload_warnings_of_layers_a_sync_leaves_out_are_quieted(caplog):
    """vLLM's in-place reload warns about every layer a sync leaves out on purpose; our own check of what was not
    reached stands instead. Its errors still show, and the loggers' levels come back after the load."""
    from colossal_rl.rollout.vllm_weights import RELOAD_LOGGERS

    reload_logger = logging.getLogger(RELOAD_LOGGERS[0])

    class ReloadingWorker(FakeWorker):
        def reload_weights(self, weights_iterator, is_checkpoint_format):
            pairs = list(weights_iterator)
            reload_logger.warning("RotaryEmbedding: Failed to load weights")
            reload_logger.error("a real failure")
            self.model_runner.model.load_weights(pairs)

    config = tiny_config("qwen2", tied=True)
    weights = to_vllm_weights(hf_state_dict(config), tie_word_embeddings=True)
    model = FakeVllmModel(vllm_073_parameter_names(config, qkv_bias=True))
    with caplog.at_level(logging.INFO):
        assert load_weights_on_worker(ReloadingWorker(model), weights) == []
    messages = [record.getMessage() for record in caplog.records if record.name == RELOAD_LOGGERS[0]]
    assert messages == ["a real failure"]
    assert reload_logger.level == logging.NOTSET
