"""A bigger copy of a trained Qwen2/Qwen3 checkpoint that computes exactly the same function: a model the size
people's benchmarks need, which still does the embedded task (a random model of that size cannot end a response).

Two function-preserving growths (Net2Net-style; nothing is trained):

- **Wider MLPs** (``--intermediate-size``): each layer's new MLP units get random gate/up rows and all-zero
  ``down_proj`` columns, so they add nothing to the residual stream.
- **More layers** (``--layers``): new decoder layers are appended with random weights except ``o_proj`` and
  ``down_proj``, which are zero: each adds nothing to the residual stream, so it is the identity.

The forward and every greedy token stay the original's (checked on save: the logits of a few prompts agree to
1e-5); training then moves the new weights away from zero like any others. Compute and weight bytes grow as in a
model of the new size, which is what throughput measurements on CPU need.

    python scripts/widen_model.py --out /tmp/wide_10m --intermediate-size 4096 --layers 6
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.config import EMBEDDED_MODEL_DIR  # noqa: E402

logger = logging.getLogger("widen_model")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")  # fmt: skip


def widened_state(source: torch.nn.Module, target: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``target``'s state dict (already randomly initialised, bigger) with ``source``'s weights in place and the
    new parts set so that they add nothing: zero ``down_proj`` columns of new units, zero ``o_proj``/``down_proj``
    of new layers."""
    generator = torch.Generator().manual_seed(seed)
    old, new = source.state_dict(), target.state_dict()
    old_layers = source.config.num_hidden_layers
    state = {}
    for name, tensor in new.items():
        tensor = tensor.clone()
        if name in old and old[name].shape != tensor.shape:  # a wider MLP: gate/up rows or down_proj columns
            original = old[name]
            if name.endswith("mlp.down_proj.weight"):
                tensor.zero_()
                tensor[:, : original.shape[1]] = original
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
                tensor[: original.shape[0]] = original
        elif name in old:
            tensor = old[name].clone()
        else:  # a new layer
            layer = int(name.split(".")[2])
            assert layer >= old_layers, name
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                tensor.zero_()
            elif name.endswith("bias") or "norm" in name:
                pass  # initialised: zeros / ones
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
        state[name] = tensor
    return state


def check_same_function(source: torch.nn.Module, target: torch.nn.Module) -> float:
    """Largest |logit difference| between the two models on a few token sequences."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, source.config.vocab_size, (4, 24), generator=generator)
    with torch.no_grad():
        return float((source(input_ids=ids).logits - target(input_ids=ids).logits).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=EMBEDDED_MODEL_DIR)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--intermediate-size", type=int, default=None, help="MLP width (at least the source's)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (at least the source's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source = AutoModelForCausalLM.from_pretrained(args.source, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(args.source)
    intermediate = args.intermediate_size or config.intermediate_size
    layers = args.layers or config.num_hidden_layers
    if intermediate < config.intermediate_size or layers < config.num_hidden_layers:
        raise SystemExit(f"--intermediate-size/--layers: at least the source's {config.intermediate_size}/"
                         f"{config.num_hidden_layers}")  # fmt: skip
    config.intermediate_size, config.num_hidden_layers = intermediate, layers
    config.max_window_layers = max(getattr(config, "max_window_layers", layers) or layers, layers)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    target.load_state_dict(widened_state(source, target, args.seed))
    target.tie_weights()
    difference = check_same_function(source, target)
    if difference > 1e-5:
        raise SystemExit(f"the widened model computes another function: logits differ by {difference:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    target.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    parameters = sum(p.numel() for p in target.parameters())
    logger.info("%s: %.2f M parameters (intermediate %d, %d layers); logits equal the source's to %.1e",
                args.out, parameters / 1e6, intermediate, layers, difference)  # fmt: skip


if __name__ == "__main__":
    main()
