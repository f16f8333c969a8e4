"""Stage 01's settings: the target's tokenizer, the chats, the length cap and the held-out split."""
from __future__ import annotations

from dataclasses import dataclass

from eagle3.core.config import StageConfig, data_sources, param


@dataclass(kw_only=True)
class PrepareConfig(StageConfig):
    target_model: str = param(help="target model folder or hub id (its tokenizer and chat template are used)")
    data: list[str] = param(help="chat files (.json/.jsonl, ShareGPT or OpenAI messages), datasets ids, or "
                                 "`generated` for stage 00's regenerated chats (00_generate/)")
    data_split: str = param("train", help="split to read from datasets ids")
    max_length: int = param(4096, min=8, help="truncate samples to this many tokens")
    eval_fraction: float = param(0.02, min=0.0, lt=1.0, help="share of conversations held out for evaluation")
    seed: int = param(0, help="seed of the train/eval split (by conversation)")
    strict: bool = param(False, help="stop at the first bad record instead of counting it")
    num_workers: int = param(0, identity=False, help="tokenizer processes (0 = auto: CPUs - 1, max 16, "
                                                    "one per 5000 records)")

    def __post_init__(self):
        self.data = data_sources(self.data, "prepare")
        super().__post_init__()  # the choices and ranges declared with the fields
