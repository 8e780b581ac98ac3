"""Loading a text tokenizer so that both environments tokenize alike.

The trainers run transformers 4.51, the vLLM producers transformers 5. For a checkpoint whose
``tokenizer_config.json`` names the generic ``PreTrainedTokenizer(Fast)`` (a tokenizer defined wholly by its
``tokenizer.json``, like the embedded model's character vocabulary), transformers 5's ``AutoTokenizer`` builds the
class of the model type instead (``Qwen2Tokenizer``), whose own pre-tokenizer dropped every space of our prompts
(measured: "Please reason" -> 13 tokens instead of 14; eval accuracy 0.015 instead of 0.215). Such checkpoints are
loaded as ``PreTrainedTokenizerFast`` from their ``tokenizer.json`` in both versions; every other one as
``AutoTokenizer`` does.
"""

from __future__ import annotations

from typing import Any

GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizer", "PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    declared = get_tokenizer_config(model_path).get("tokenizer_class")
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(model_path)
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
