"""Methods mixed into every vLLM worker (``worker_extension_cls``), called by name through ``LLM.collective_rpc``.

They run inside vLLM's worker processes, in the producers' environment; each delegates to a pure function of
``vllm_weights`` (tested on a fake worker). Names carry a ``colossal_rl_`` prefix: vLLM refuses an extension whose
attributes clash with the worker's own.
"""

from __future__ import annotations

from colossal_rl.rollout import vllm_weights


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

    def colossal_rl_unpack_only(self, packed: list[vllm_weights.PackedTensor]) -> int:
        """Receive and unpack weights without loading them (``benchmarks/vllm_producer.py --sync``: the RPC
        transport's share of a weight load); the bytes received."""
        return sum(tensor.numel() * tensor.element_size() for _, tensor in vllm_weights.unpack_tensors(packed))
