"""The pipeline's stages, in order: the one registry every other part reads.

The work directory takes its folder names from here, a YAML file's sections are the
stages' keys, the numbered scripts start their stage through `Stage.main`, and the
"run X first" hints name `Stage.script`. A new stage is one line in `STAGES` plus its
package under eagle3/stages/.

Each stage is a package `eagle3.stages.sNN_<key>` with `config.py` (its settings, one
dataclass) and `run.py` (its entry function). Stages read each other's results only
from disk, through the readers in eagle3/artifacts/, never by importing another stage.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    key: str  # the YAML section and the name code uses: "train"
    folder: str  # WORK/<folder>/, numbered: "04_train"
    script: str  # the top-level command: "04_train_drafter.py"
    package: str  # "eagle3.stages.s04_train"
    config_class: str  # in <package>.config
    entry: str  # in <package>.run: takes the config, runs the stage

    @property
    def number(self) -> str:
        """'04': the prefix of the stage's folder and script."""
        return self.folder[:2]

    def config_type(self) -> type:
        return getattr(importlib.import_module(f"{self.package}.config"), self.config_class)

    def entry_function(self):
        return getattr(importlib.import_module(f"{self.package}.run"), self.entry)


STAGES: tuple[Stage, ...] = (
    Stage("generate", "00_generate", "00_generate_responses.py", "eagle3.stages.s00_generate",
          "GenerateConfig", "generate_responses"),
    Stage("prepare", "01_dataset", "01_prepare_dataset.py", "eagle3.stages.s01_prepare",
          "PrepareConfig", "prepare_dataset"),
    Stage("extract", "02_hidden_states", "02_extract_hidden_states.py", "eagle3.stages.s02_extract",
          "ExtractConfig", "extract_hidden_states"),
    Stage("vocab", "03_vocab", "03_build_vocab_mapping.py", "eagle3.stages.s03_vocab",
          "VocabConfig", "build_vocab_mapping"),
    Stage("train", "04_train", "04_train_drafter.py", "eagle3.stages.s04_train",
          "TrainConfig", "train_drafter"),
    Stage("export", "05_export", "05_export_drafter.py", "eagle3.stages.s05_export",
          "ExportConfig", "export_drafter"),
    Stage("evaluate", "06_evaluate", "06_evaluate_drafter.py", "eagle3.stages.s06_evaluate",
          "EvaluateConfig", "evaluate_drafter"),
)
STAGE = {s.key: s for s in STAGES}


def stage_index(key: str) -> int:
    """Position in the pipeline (0 for "generate"): what "upstream" means."""
    return [s.key for s in STAGES].index(key)
