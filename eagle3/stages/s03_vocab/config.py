"""Stage 03's settings: which work directory, and how many target tokens the drafter predicts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.config import StageConfig, param


@dataclass(kw_only=True)
class VocabConfig(StageConfig):
    work_dir: Path = param(help="work directory (stage 01 must have run in it)")
    target_model: str | None = param(None, help="target model; when given, its tokenizer must be stage 01's")
    draft_vocab_size: int = param(32000, min=1, help="number of target tokens the drafter predicts")
