"""Logging setup: one fixed format, rank 0 only, chatty third-party loggers quieted.

Custom tokenizers (Kimi's tiktoken one) log on every encode; left alone they drown
the progress bars, so `quiet_tokenizers()` raises those loggers to WARNING.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

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


def log_to_file(path) -> None:
    """Also append every log line of this process (rank 0) to `path`: a run over SSH that
    lost its terminal keeps its log in the work dir."""
    if rank() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve() for h in root.handlers):
        return
    h = logging.FileHandler(path, mode="a", encoding="utf-8")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    root.addHandler(h)


def quiet_tokenizers() -> None:
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
