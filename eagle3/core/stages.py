"""The pipeline's stages, in order: the one registry every other part reads.

The work directory takes its folder names from here, a YAML file's sections are the
stages' keys, and the "run X first" hints name `Stage.script`. A new stage is one line
in `STAGES`, its package under eagle3/stages/, its config in eagle3/stages/configs.py
and its numbered script.

Each stage is a package `eagle3.stages.sNN_<key>` with `config.py` (its settings, one
dataclass) and `run.py` (its entry function). Its numbered script imports both by name
and hands them to eagle3/core/cli.py `run_stage`, so a reader follows the script to its
code; the registry holds no module names. Stages read each other's results only from
disk, through the readers in eagle3/artifacts/, never by importing another stage.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    key: str  # the YAML section and the name code uses: "train"
    folder: str  # WORK/<folder>/, numbered: "04_train"
    script: str  # the top-level command: "04_train_drafter.py"

    @property
    def number(self) -> str:
        """'04': the prefix of the stage's folder and script."""
        return self.folder[:2]


STAGES: tuple[Stage, ...] = (
    Stage("generate", "00_generate", "00_generate_responses.py"),
    Stage("prepare", "01_dataset", "01_prepare_dataset.py"),
    Stage("extract", "02_hidden_states", "02_extract_hidden_states.py"),
    Stage("vocab", "03_vocab", "03_build_vocab_mapping.py"),
    Stage("train", "04_train", "04_train_drafter.py"),
    Stage("export", "05_export", "05_export_drafter.py"),
    Stage("evaluate", "06_evaluate", "06_evaluate_drafter.py"),
)
STAGE = {s.key: s for s in STAGES}


def stage_index(key: str) -> int:
    """Position in the pipeline (0 for "generate"): what "upstream" means."""
    return [s.key for s in STAGES].index(key)
