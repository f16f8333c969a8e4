"""Logging setup: one fixed format, rank 0 only, chatty third-party loggers quieted.

Custom tokenizers (Kimi's tiktoken one) log on every encode; left alone they drown
the progress bars, so `quiet_tokenizers()` raises those loggers to WARNING.
"""
from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
NOISY = ("transformers", "transformers_modules", "tiktoken", "datasets", "httpx",
         "huggingface_hub", "filelock", "urllib3", "fsspec")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def setup_logging(level: int = logging.INFO) -> None:
    if rank() != 0:
        level = logging.WARNING
    logging.basicConfig(level=level, format=FORMAT, datefmt="%H:%M:%S", force=True)
    quiet_tokenizers()


def quiet_tokenizers() -> None:
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
