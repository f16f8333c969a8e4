"""Every stage's config class by its YAML section: what a YAML file is checked against.

A YAML file in configs/ holds every stage's section, so reading it for one stage still
refuses a key that no stage has (eagle3/core/config.py `check_yaml_keys`). The core
cannot import the stages, so whoever reads a YAML file passes this map in: the numbered
scripts (`run_stage(..., sections=STAGE_CONFIGS)`), the tools and the tests.

The one module of eagle3/stages/ that imports other stages' packages, and only their
config.py (tests/unit/test_layout.py); no stage imports it. The order is the registry's
(eagle3/core/stages.py `STAGES`).
"""
from __future__ import annotations

from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s05_export.config import ExportConfig
from eagle3.stages.s06_evaluate.config import EvaluateConfig

STAGE_CONFIGS: dict[str, type] = {
    "generate": GenerateConfig,
    "prepare": PrepareConfig,
    "extract": ExtractConfig,
    "vocab": VocabConfig,
    "train": TrainConfig,
    "export": ExportConfig,
    "evaluate": EvaluateConfig,
}
