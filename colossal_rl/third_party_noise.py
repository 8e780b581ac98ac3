"""Silence what third-party packages print at import about optional accelerators we do not use.

ColossalAI imports TensorNVMe, apex and bitsandbytes unconditionally; on a machine without them each
process prints warnings that mean nothing to a user (async safetensors saving, fused RMSNorm kernels, 4-bit
CPU kernels) and bury our own lines. Each filter below names one message and the module it comes from;
every other warning, ours included, still shows. Applied on importing ``colossal_rl``, so the driver and
every Ray actor get it before ColossalAI is imported.
"""

from __future__ import annotations

import logging
import warnings

OPTIONAL_ACCELERATOR_WARNINGS = (
    # (message regex, module regex of the warnings.warn call)
    (r"Please install the latest tensornvme", r"colossalai\.utils\.safetensors"),
    (r"Please install apex from source", r"colossalai\.shardformer\.layer\.normalization"),
)
OPTIONAL_ACCELERATOR_LOGGERS = ("bitsandbytes.backends.cpu.ops",)
"""Loggers that only report optional kernels missing (``kernels-community`` 4-bit CPU ops) at WARNING."""
NOTICE_LOGGERS = {
    # transformers 4.51 on loading a saved (slow) image processor: the slow one is what the checkpoint asks for,
    # and what every producer, trainer and the export load alike; asking for it explicitly (use_fast=False)
    # would also make AutoProcessor load the slow tokenizer, which a fast-only tokenizer does not have.
    "transformers.models.auto.image_processing_auto": "Using a slow image processor as `use_fast` is unset",
}
"""Logger -> the start of one message of it that is a notice, not a problem; the logger's other lines still show."""


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_optional_accelerator_notices() -> None:
    for message, module in OPTIONAL_ACCELERATOR_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name in OPTIONAL_ACCELERATOR_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, prefix in NOTICE_LOGGERS.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in target.filters):
            target.addFilter(_DropMessage(prefix))
