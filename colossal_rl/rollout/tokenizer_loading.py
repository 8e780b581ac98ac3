"""Loading a text tokenizer so that both environments tokenize alike.

The trainers run transformers 4.51, the vLLM producers transformers 5. For a checkpoint whose
``tokenizer_config.json`` names the generic ``PreTrainedTokenizer(Fast)`` (a tokenizer defined wholly by its
``tokenizer.json``, like the embedded model's character vocabulary), transformers 5's ``AutoTokenizer`` builds the
class of the model type instead (``Qwen2Tokenizer``), whose own pre-tokenizer dropped every space of our prompts
(measured: "Please reason" -> 13 tokens instead of 14; eval accuracy 0.015 instead of 0.215). Such checkpoints are
loaded as ``PreTrainedTokenizerFast`` from their ``tokenizer.json`` in both versions; every other one as
``AutoTokenizer`` does. A vision-language model's processor (``load_processor``) gets the same treatment for its
tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizer", "PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    declared = get_tokenizer_config(model_path).get("tokenizer_class")
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(model_path)
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def load_processor(model_path: str, *, trust_remote_code: bool = False) -> Any:
    """A vision-language model's processor whose tokenizer tokenizes as the trainers' (transformers 4.51) does.

    transformers 5 builds a processor's tokenizer as the class its config names (the embedded tiny VLM's says
    ``Qwen2Tokenizer``), whose own pre-tokenizer replaces the one in ``tokenizer.json``: the tiny VLM's character
    vocabulary then lost every space (measured in the producers' environment: "Count the shapes." became
    "Counttheshapes."). transformers 4.51's fast tokenizers load ``tokenizer.json`` as it is;
    so does ``PreTrainedTokenizerFast``, which replaces the processor's tokenizer of a local checkpoint that has one.
    """
    from transformers import AutoProcessor, PreTrainedTokenizerFast

    processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if (Path(model_path) / "tokenizer.json").is_file():
        processor.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    return processor
