"""The work directory: the one module that knows the pipeline's file names.

Layout (one folder per stage, each finished by a manifest written last):

    WORK/00_generate/       chunks/chunk-NNNNN.jsonl (+ .json): chats with the target's own answers
    WORK/01_dataset/        train/ eval/ (datasets Arrow), token_freq_{split}.npy
    WORK/02_hidden_states/  the hidden-state store (see eagle3/artifacts/store/format.py)
    WORK/03_vocab/          d2t.pt t2d.pt
    WORK/04_train/          checkpoints/, metrics.jsonl
    WORK/05_export/         config.json model.safetensors export_report.json
    WORK/06_evaluate/       results.json evaluate.png untrained_drafter/ runs/ logs/
                            (--select-checkpoint) selection.json candidates/step-NNNNNNN/
    WORK/*/manifest.json
    WORK/logs/              NN_stage.log per numbered stage, window_loop.log (appended across reruns)

Every other module asks a `WorkDir` for a path instead of spelling it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.stages import STAGE

MANIFEST_NAME = "manifest.json"
# The checkout this package lives in: its data/ and the numbered scripts sit there.
REPO_ROOT = Path(__file__).resolve().parents[2]

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class WorkDir:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    def stage_dir(self, stage: str) -> Path:
        return self.root / STAGE[stage].folder

    def manifest(self, stage: str) -> Path:
        return self.stage_dir(stage) / MANIFEST_NAME

    @staticmethod
    def script(stage: str) -> str:
        return STAGE[stage].script

    @staticmethod
    def number(stage: str) -> str:
        """'04' for "train": the prefix of the stage's folder and script."""
        return STAGE[stage].number

    # -- logs: one file per stage (and per tool that runs stages), appended across reruns --
    def log_file(self, name: str) -> Path:
        """WORK/logs/{name}.log, e.g. `02_extract`, `window_loop`."""
        return self.root / "logs" / f"{name}.log"

    # -- stage 00: generate ---------------------------------------------------
    def generate_identity(self) -> Path:
        return self.stage_dir("generate") / "generate.json"

    def generate_chunks(self) -> Path:
        return self.stage_dir("generate") / "chunks"

    def generate_chunk(self, chunk: int) -> Path:
        """The regenerated conversations of one chunk (JSONL, one line per input record)."""
        return self.generate_chunks() / f"chunk-{chunk:05d}.jsonl"

    def generate_chunk_meta(self, chunk: int) -> Path:
        """Written after the chunk's JSONL: its identity, counts and checksum (the completion mark)."""
        return self.generate_chunks() / f"chunk-{chunk:05d}.json"

    # -- stage 01: prepare ---------------------------------------------------
    def dataset(self, split: str) -> Path:
        assert split in SPLITS, split
        return self.stage_dir("prepare") / split

    def token_freq(self, split: str) -> Path:
        assert split in SPLITS, split
        return self.stage_dir("prepare") / f"token_freq_{split}.npy"

    # -- stage 02: extract (the store's own file names live in eagle3/artifacts/store/format.py) --
    def store(self) -> Path:
        return self.stage_dir("extract")

    # -- stage 03: vocab -----------------------------------------------------
    def d2t(self) -> Path:
        return self.stage_dir("vocab") / "d2t.pt"

    def t2d(self) -> Path:
        return self.stage_dir("vocab") / "t2d.pt"

    # -- stage 04: train -----------------------------------------------------
    def checkpoints(self) -> Path:
        return self.stage_dir("train") / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints() / f"step-{step:07d}.pt"

    @staticmethod
    def checkpoint_step(path: Path | str) -> int | None:
        """The step a `checkpoint(step)` file was written at; None for any other name."""
        m = re.fullmatch(r"step-(\d+)\.pt", Path(path).name)
        return int(m.group(1)) if m else None

    def best_checkpoint(self) -> Path:
        return self.checkpoints() / "best.pt"

    def latest_checkpoint(self) -> Path:
        return self.checkpoints() / "latest.json"

    def tensorboard_dir(self) -> Path:
        return self.stage_dir("train") / "tensorboard"

    def tracker_dir(self) -> Path:
        """Local files of stage 04's other trackers (wandb's offline run, MLflow's file store)."""
        return self.stage_dir("train") / "trackers"

    def train_metrics(self) -> Path:
        return self.stage_dir("train") / "metrics.jsonl"

    # -- stage 05: export ----------------------------------------------------
    def export_dir(self) -> Path:
        return self.stage_dir("export")

    def export_report(self, suffix: str = "json") -> Path:
        """Stage 05's report: `json` (what stage 06 reads) or `md` (for people)."""
        assert suffix in ("json", "md"), suffix
        return self.stage_dir("export") / f"export_report.{suffix}"

    # -- stage 06: evaluate --------------------------------------------------
    def evaluate_dir(self) -> Path:
        return self.stage_dir("evaluate")

    def evaluate_results(self) -> Path:
        """Every figure stage 06 measured (eagle3/stages/s06_evaluate/report.py)."""
        return self.stage_dir("evaluate") / "results.json"

    def evaluate_plot(self) -> Path:
        return self.stage_dir("evaluate") / "evaluate.png"

    def untrained_drafter(self) -> Path:
        """The baseline drafter folder: the exported config and mapping, fresh weights."""
        return self.stage_dir("evaluate") / "untrained_drafter"

    def selection_candidate(self, step: int) -> Path:
        """--select-checkpoint: the scratch drafter folder of stage 04's checkpoint at `step`."""
        return self.stage_dir("evaluate") / "candidates" / f"step-{step:07d}"

    def selection_results(self) -> Path:
        """--select-checkpoint: each candidate's served figures and the choice."""
        return self.stage_dir("evaluate") / "selection.json"

    def engine_request(self, run: str) -> Path:
        """What one stage-06 engine run ("plain", "trained", "untrained") is asked."""
        return self.stage_dir("evaluate") / "runs" / f"{run}.request.json"

    def engine_result(self, run: str) -> Path:
        return self.stage_dir("evaluate") / "runs" / f"{run}.result.json"

    def engine_log(self, run: str) -> Path:
        return self.stage_dir("evaluate") / "logs" / f"{run}.log"
