"""Methods mixed into every vLLM worker (``worker_extension_cls``), called by name through ``LLM.collective_rpc``.

They run inside vLLM's worker processes, in the producers' environment; each delegates to a pure function of
``vllm_weights`` (tested on a fake worker). Names carry a ``colossal_rl_`` prefix: vLLM refuses an extension whose
attributes clash with the worker's own.
"""

from __future__ import annotations

from typing import Any

from colossal_rl.rollout import vllm_weights, vllm_worker_receive


class WeightLoaderExtension:
    """Weight loading and reading for the producer's engine; ``self`` is the vLLM worker."""

    def colossal_rl_load_weights(
        self, packed: list[vllm_weights.PackedTensor], architecture: str | None, omissible: list[str]
    ) -> list[str]:
        """Load Hugging Face-named weights (``vllm_weights.pack_tensors``) into this worker's shard; the parameters
        not reached."""
        weights = vllm_weights.unpack_tensors(packed)
        return vllm_weights.load_weights_on_worker(self, weights, architecture, tuple(omissible))

    def colossal_rl_named_weights(self) -> list[vllm_weights.PackedTensor]:
        """A CPU copy of this worker's parameters (vLLM's fused names and shapes), packed."""
        return vllm_weights.pack_tensors(vllm_weights.named_weights_on_worker(self).items())

    def colossal_rl_join_weight_sync(self, routes: list[dict[str, Any]], timeout_s: float, transport: str) -> None:
        """Join every pipeline stage's weight sync as this worker's member of the producer's routes (collective
        with the sender); a group joined before (the sync formed again) is left first. On a GPU, refuses in one line
        receive buffers that do not fit beside vLLM's memory budget (``vllm_worker_receive.receive_budget_check``)."""
        from colossal_rl.comm.process_group import default_device

        self.colossal_rl_leave_weight_sync()
        device = default_device()
        self._colossal_rl_receivers = vllm_worker_receive.open_worker_receivers(
            routes,
            member=self.rank,
            timeout_s=timeout_s,
            transport=transport,
            device=device,
            before_allocating=vllm_worker_receive.receive_budget_check(self, device),
        )

    def colossal_rl_receive_weights(
        self, policy_version: int, loaded_version: int, architecture: str | None, tied: bool, omissible: list[str]
    ) -> list[str]:
        """Receive sync ``policy_version`` and load it into this worker's shard; the parameters not reached."""
        return vllm_worker_receive.receive_and_load(
            self,
            getattr(self, "_colossal_rl_receivers", []),
            policy_version=policy_version,
            loaded_version=loaded_version,
            architecture=architecture,
            tie_word_embeddings=tied,
            omissible=tuple(omissible),
        )

    def colossal_rl_leave_weight_sync(self) -> None:
        vllm_worker_receive.close_receivers(getattr(self, "_colossal_rl_receivers", []))
        self._colossal_rl_receivers = []
