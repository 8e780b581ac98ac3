"""One micro-batch's policy forward, in the configured sequence layout: the trainer's model-facing half.

Decides the micro-batches of a chunk (``training/micro_batches.py``), lays each out
(``training/sequence_layout.py``: padded, packed or shared-prompt), runs the model, gathers vocabulary-sharded
logits under tensor parallelism, and turns the outputs into per-sample response log-probs [n, R] and entropy.
Whether the output head runs inside the model (full logits) or chunk by chunk from hidden states is
decided here too (:meth:`MicroBatchForward.output_head`). No loss, no optimizer; the one collective is the
data-parallel maximum of micro-batch counts, reached through the ``max_over_ranks`` callback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import PACKED_VISION_UNDER_FLASH_ATTENTION, RLConfig
from colossal_rl.training import micro_batches
from colossal_rl.training.layout_choice import cheaper_block_layout, pair_weight
from colossal_rl.training.objective import objective_for
from colossal_rl.training.policy_forward import output_head_returns_hidden, response_terms, unwrap_model
from colossal_rl.training.sequence_layout import ForwardLayout, block_layout, padded_layout
from colossal_rl.training.step_loss import StepTotals
from colossal_rl.vision.inputs import model_vision_kwargs
from colossal_rl.vision.rope import RopeTokens, sequence_positions


class ForwardTerms(NamedTuple):
    logprobs: torch.Tensor
    """[n, R] the responses' log-probs (fp32, zero at padding)."""
    entropy: torch.Tensor | None
    layout: ForwardLayout
    router_balance: torch.Tensor | None = None
    """A mixture-of-experts policy's load-balancing loss over the forward's real tokens (``moe/routing.py``), when
    ``train.router_aux_loss_coef`` > 0; else None."""


SLIDING_WINDOW_LAYOUT = (
    "--sequence-layout {layout}: the policy attends within a sliding window, which the block mask of a packed or "
    "shared-prompt row does not keep; use padded (or auto, which picks it for such a model)"
)


def attends_in_sliding_window(model_config) -> bool:
    """Whether some layer of the model attends only within a sliding window (its config's ``sliding_window``, on
    and used by a layer type): such a model trains in the padded layout, whose 2D mask transformers turns into the
    window's mask; the 4D block masks of the packed and shared-prompt rows would attend past it."""
    text = model_config.get_text_config()
    if not getattr(text, "sliding_window", None) or getattr(text, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(text, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


class MicroBatchForward:
    def __init__(
        self,
        config: RLConfig,
        *,
        dtype: torch.dtype,
        pad_token_id: int,
        tp_group: torch.distributed.ProcessGroup | None,
        vocab_size: int,
        max_over_ranks: Callable[[int], int] | None,
        rope_tokens: RopeTokens | None = None,
        head_weight_outside_forward: bool = True,
        forward_is_collective: bool = False,
        sliding_window: bool = False,
    ):
        """``tp_group``: set when logits come vocabulary-sharded (tensor parallelism). ``max_over_ranks``: the
        maximum of an int over the data-parallel ranks (None: a single data-parallel rank). ``rope_tokens``: a
        vision-language policy's image tokens (``vision/rope.py``): batches with images then get multimodal
        positions and their images. ``head_weight_outside_forward`` and ``forward_is_collective``: the training
        engine's (``engines/base.py``): log-probs from hidden states need the first; the second makes every forward,
        no-grad ones too, run as many micro-batches on every data-parallel rank."""
        self.config = config
        self.head_weight_outside_forward = head_weight_outside_forward
        self.forward_is_collective = forward_is_collective
        self.layout = config.sequence_layout_for(vision_language=rope_tokens is not None)
        if sliding_window and self.layout != "padded":  # ``attends_in_sliding_window``
            if config.train.sequence_layout != "auto":
                raise ValueError(SLIDING_WINDOW_LAYOUT.format(layout=self.layout))
            self.layout = "padded"
        self.by_shape = (
            config.train.sequence_layout == "auto"
            and self.layout == "shared_prompt"
            and config.train.max_tokens_per_microbatch is None
        )
        """``--sequence-layout auto`` resolved to shared_prompt: each micro-batch is laid out packed instead when
        that computes less (long responses; ``layout_choice.py``). Not under a token budget: its micro-batches are
        planned by what shared_prompt computes, and packed would compute more than the budget allows."""
        self._pair_weight: float | None = None
        if (
            self.layout == "packed"
            and rope_tokens is not None
            and config.train.attn_implementation == "flash_attention_2"
        ):
            raise ValueError(PACKED_VISION_UNDER_FLASH_ATTENTION)
        self.dtype = dtype
        self.pad_token_id = pad_token_id
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.max_over_ranks = max_over_ranks
        self.rope_tokens = rope_tokens

    @contextlib.contextmanager
    def output_head(self, model: torch.nn.Module) -> Iterator[torch.Tensor | None]:
        """Yields the output head's weight when log-probs come from hidden states, else None (full logits)."""
        if self.config.train.logits_from_hidden and self.tp_group is None and self.head_weight_outside_forward:
            with output_head_returns_hidden(model) as weight:
                yield weight
        else:
            yield None

    def micro_ranges(self, chunk: RolloutBatch, *, same_count_on_every_rank: bool) -> list[tuple[int, int]]:
        """Sample ranges of ``chunk``'s micro-batches: ``train.microbatch_size`` samples each, or within
        ``train.max_tokens_per_microbatch`` tokens (whole groups under shared_prompt, and for an objective that
        compares a group's samples).
        ``same_count_on_every_rank``: a budgeted plan gets the data-parallel ranks' largest count (each backward
        all-reduces gradients, so every rank must run as many)."""
        train = self.config.train
        shared, padded = self.layout == "shared_prompt", self.layout == "padded"
        whole_groups = shared or objective_for(self.config.algorithm).whole_groups
        units = micro_batches.make_units(
            chunk.prompt_mask.sum(1).tolist(),
            chunk.response_mask.sum(1).tolist(),
            chunk.group_size if whole_groups else 1,
        )
        if train.max_tokens_per_microbatch is None:
            return micro_batches.by_count(units, train.microbatch_size)
        parts = micro_batches.by_budget(units, train.max_tokens_per_microbatch, padded=padded, shared_prompt=shared)
        if (same_count_on_every_rank or self.forward_is_collective) and self.max_over_ranks is not None:
            count = self.max_over_ranks(len(parts))
            parts = micro_batches.by_budget_in_exactly(units, count, padded=padded, shared_prompt=shared)
        return micro_batches.sample_ranges(parts)

    def layout_name(self, part: RolloutBatch, group_size: int) -> str:
        """The layout one micro-batch is laid out in: the configured one, or (``by_shape``) the cheaper of
        shared_prompt and packed for its lengths."""
        if not self.by_shape or self._pair_weight is None:
            return self.layout
        return cheaper_block_layout(part.prompt_mask.sum(1).tolist(), part.response_mask.sum(1).tolist(), group_size,
                                    self._pair_weight)  # fmt: skip

    def layout_of(self, part: RolloutBatch, group_size: int) -> ForwardLayout:
        """The layout of one micro-batch's samples, built on the samples' device."""
        tensors = (part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask)
        positions = self._prompt_positions(part)
        layout = self.layout_name(part, group_size)
        if layout == "padded":
            return padded_layout(*tensors, prompt_positions=positions)
        flash = self.config.train.attn_implementation == "flash_attention_2"
        return block_layout(
            *tensors,
            group_size=group_size,
            shared_prompt=layout == "shared_prompt",
            pad_token_id=self.pad_token_id,
            mask_dtype=None if flash else self.dtype,
            prompt_positions=positions,
        )

    def _prompt_positions(self, part: RolloutBatch) -> list[torch.Tensor] | None:
        """Each sample's multimodal prompt positions [3, p] when ``part`` has images, else None (1D positions)."""
        if not part.vision:
            return None
        if self.rope_tokens is None:
            raise ValueError("a batch with images reached a text-only policy")
        prompt_ids, prompt_mask = part.prompt_ids.cpu(), part.prompt_mask.cpu().bool()
        return [
            sequence_positions(prompt_ids[s][prompt_mask[s]], None if v is None else v.image_grid_thw, self.rope_tokens)
            for s, v in enumerate(part.vision)
        ]

    def model_inputs(
        self, model: torch.nn.Module, part: RolloutBatch, forward: ForwardLayout
    ) -> dict[str, torch.Tensor | None]:
        """The forward's keyword inputs: the layout's; with images, input embeddings that carry the vision
        tower's features of the prompts the rows hold, in their order (:func:`embed_with_images`)."""
        if not part.vision:
            return forward.inputs
        owners = [part.vision[s] for s in forward.prompt_owners]
        images = model_vision_kwargs(owners, part.prompt_ids.device, self.dtype)
        inputs = dict(forward.inputs)
        input_ids = inputs.pop("input_ids")
        inputs["inputs_embeds"] = embed_with_images(
            unwrap_model(model), input_ids, forward.prompt_token_mask, images, self.rope_tokens.image_token_id
        )
        return inputs

    def terms(
        self,
        model: torch.nn.Module,
        part: RolloutBatch,
        group_size: int,
        head_weight: torch.Tensor | None,
        *,
        with_entropy: bool,
        totals: StepTotals | None = None,
    ) -> ForwardTerms:
        """One forward of ``model`` over a micro-batch in its layout: log-probs [n, R], entropy or None, the
        layout, and (mixture of experts with ``train.router_aux_loss_coef`` > 0) the routers' balance loss.

        ``group_size``: samples per prompt group of the chunk ``part`` comes from (``part`` starts at a group).
        With routing replay and routes in ``part``, the forward uses the producer's expert choices; ``totals``
        then counts the replayed tokens whose choice differs from the trainer's own router.
        """
        if self.by_shape and self._pair_weight is None:
            self._pair_weight = pair_weight(unwrap_model(model).config)
        forward = self.layout_of(part, group_size)
        router_balance = None
        with self._routing(model, part, forward) as session:
            outputs = self._full_vocabulary(model(**self.model_inputs(model, part, forward)).logits, head_weight)
            if session is not None and self.config.train.router_aux_loss_coef > 0:
                router_balance = session.balance_loss(forward.per_position(part.prompt_mask, part.response_mask, 0))
        if session is not None and totals is not None and session.replay is not None:
            totals.add("train/routed_tokens_replayed", session.replayed)
            totals.add("train/routed_tokens_differing", session.differing)
        logprobs, entropy = forward.response_terms(
            outputs,
            part.response_ids,
            temperature=self.config.generation.temperature,
            head_weight=head_weight,
            with_entropy=with_entropy,
        )
        return ForwardTerms(logprobs, entropy, forward, router_balance)

    @contextlib.contextmanager
    def _routing(self, model: torch.nn.Module, part: RolloutBatch, forward: ForwardLayout) -> Iterator:
        """The MoE routing session of one forward (``moe/blocks.py``): replaying ``part``'s recorded routes in
        ``forward``'s layout (routing replay), and/or keeping the routers' logits for their balance loss
        (``train.router_aux_loss_coef``); None when neither is asked for."""
        replay = self.config.model.routing_replay and part.prompt_routes is not None
        if not replay and self.config.train.router_aux_loss_coef <= 0:
            yield None
            return
        from colossal_rl.moe.blocks import moe_routing
        from colossal_rl.moe.routing import NOT_RECORDED

        routes = forward.per_position(part.prompt_routes, part.response_routes, NOT_RECORDED) if replay else None
        with moe_routing(unwrap_model(model), replay=routes) as session:
            yield session

    def padded_terms(
        self, outputs: torch.Tensor, head_weight: torch.Tensor | None, batch: RolloutBatch, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy) of ``batch``'s responses from the outputs of a forward over its padded
        ``[prompt | response]`` rows (the pipeline schedule's forward)."""
        return response_terms(
            self._full_vocabulary(outputs, head_weight),
            prompt_length=batch.prompt_ids.shape[1],
            response_ids=batch.response_ids,
            temperature=self.config.generation.temperature,
            head_weight=head_weight,
            with_entropy=with_entropy,
        )

    def _full_vocabulary(self, outputs: torch.Tensor, head_weight: torch.Tensor | None) -> torch.Tensor:
        """Logits with every vocabulary entry (gathered from the tensor-parallel shards), or hidden states as is."""
        if head_weight is not None or self.tp_group is None:
            return outputs
        from colossal_rl.training.booster_plugins import gather_vocab_parallel_logits

        return gather_vocab_parallel_logits(outputs, self.tp_group, self.vocab_size)


def embed_with_images(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_token_mask: torch.Tensor,
    images: dict[str, torch.Tensor],
    image_token_id: int,
) -> torch.Tensor:
    """Token embeddings [rows, L, H] with the vision tower's features at the prompts' image tokens.

    What Qwen2.5-VL's own forward does with ``input_ids`` and ``pixel_values``, except that only *prompt* image
    tokens take image features: an image token the policy generated was embedded as a token when it was sampled
    (decoding steps carry no pixels), so it is here too; the model's forward would instead fail (more image
    tokens than features) or misplace the features."""
    embeddings = model.get_input_embeddings()(input_ids)
    if not images:
        return embeddings
    features = model.visual(images["pixel_values"].to(model.visual.dtype), grid_thw=images["image_grid_thw"])
    slots = (input_ids == image_token_id) & prompt_token_mask.to(input_ids.device)
    if int(slots.sum()) != features.shape[0]:
        raise ValueError(f"{int(slots.sum())} image tokens in the prompts but {features.shape[0]} image features")
    return embeddings.masked_scatter(slots.unsqueeze(-1).expand_as(embeddings), features.to(embeddings.dtype))
