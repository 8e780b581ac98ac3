"""What differs between the two transformers releases our code runs under: 4.51.3 (the colossalai trainers') and
today's (the producers' environment, and fsdp2 trainers). Imports nothing of ours."""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _renamed_dtype() -> bool:
    """transformers 4.56 renamed ``from_pretrained``'s ``torch_dtype`` to ``dtype`` (the old name warns since)."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("transformers").split(".")[:2])
    return (major, minor) >= (4, 56)


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """The keyword that sets a model's dtype in ``from_pretrained`` / ``from_config`` of this transformers."""
    return {"dtype": dtype} if _renamed_dtype() else {"torch_dtype": dtype}
