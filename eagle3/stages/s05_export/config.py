"""Stage 05's settings: which checkpoint to export, where, in which dtype."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.config import DTYPE_CHOICES, StageConfig, dtype_name, param


@dataclass(kw_only=True)
class ExportConfig(StageConfig):
    work_dir: Path = param(help="work directory (stages 02 and 04 must have run in it)")
    target_model: str = param(help="target model folder or hub id the drafter will serve with")
    checkpoint: Path | None = param(None, help="stage 04 checkpoint to export (default: the best one)")
    chosen_by: str | None = param(None, identity_unless_default=True,
                                  help="how the checkpoint was chosen, in one line for the model card (stage 06's "
                                       "--select-checkpoint passes its served comparison); default: stage 04's best "
                                       "held-out expected accept length, or --checkpoint as given")
    out_dir: Path | None = param(None, help="drafter folder to write (default: WORK/05_export)")
    include_embed_tokens: bool = param(False, help="also write the target's embedding as embed_tokens "
                                                   "(the engines use the target's when it is absent)")
    base_model: str | None = param(None, help="Hub id the model card names as `base_model` (default: --target-model "
                                              "when it is a Hub id; a local target folder needs this for the "
                                              "card to link its target)")
    dtype: str = param("bfloat16", choices=DTYPE_CHOICES, help="weight dtype (bfloat16 is what the engines serve)")
    allow_engine_mismatch: bool = param(False, identity=False, help="export even when an engine rule would "
                                        "capture other layers than training used (the report says which)")
    force: bool = param(False, identity=False, help="redo the export even if it is complete")

    def __post_init__(self):
        super().__post_init__()  # the choices and ranges declared with the fields
        self.dtype = dtype_name(self.dtype)  # one spelling: `bf16` in a YAML file is stored as bfloat16
