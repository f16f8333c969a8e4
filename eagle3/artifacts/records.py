"""One typed record per stage: the facts a stage hands to later stages and tools.

Each stage ends by writing its manifest (eagle3/artifacts/manifest.py `write_manifest`) with
a frozen dataclass of this module as `record=`; it is stored as the manifest's `record`
section (`dataclasses.asdict`, so fields hold JSON types only: str, int, float, bool,
None, lists and dicts with string keys). A later stage or tool reads it back with
`read_record(workdir, stage, needed_by=...)` (the manifest's own checks, staleness included,
run first) or, holding the manifest already, `record_of(manifest)`. A fact another
stage reads lives here and nowhere else in the manifest: `counts` keeps figures that
are only reported, `extra` notes for a human reader.

A record is all or nothing: a manifest without a record section, or whose record lacks
a field of its class (written by older code) or holds one it does not know (newer
code), is refused with the manifest's path and the rerun that rewrites it; a field is
never defaulted. Adding or renaming a field is a manifest format change: bump
`manifest.FORMAT_VERSION`. docs/RECORDS.md lists every field with its writer and readers.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from eagle3.core.errors import PipelineError
from eagle3.core.stages import STAGE


@dataclass(frozen=True)
class GenerateRecord:
    """Stage 00 (eagle3/stages/s00_generate/run.py `write_results`)."""

    STAGE: ClassVar[str] = "generate"
    target_model: str
    tokenizer_fingerprint: str
    chat_template_kwargs: dict  # the template switches the answers were generated under
    stop_token_ids: list  # ids that ended an answer
    complete: bool  # every chunk of every box is in; False: the manifest lists the boxes still to run
    num_chunks: int
    missing_chunks: int
    missing_shard_indices: list  # --shard-index values of the missing chunks
    conversations: int
    turns_regenerated: int
    new_turns: int  # answers to prompts that had none in the data
    generated_tokens: int


@dataclass(frozen=True)
class PrepareRecord:
    """Stage 01 (eagle3/stages/s01_prepare/run.py `prepare_dataset`)."""

    STAGE: ClassVar[str] = "prepare"
    target_model: str
    tokenizer_fingerprint: str
    vocab_size: int  # the target's (the width of token_freq_*.npy)
    chat_template_kwargs: dict
    assistant_suffix: list  # token ids the template puts after an assistant turn
    records: int  # input records read
    bad_records: dict  # reason -> records skipped
    samples: dict  # split -> samples
    tokens: dict  # split -> tokens
    assistant_tokens: dict  # split -> tokens that carry the loss


@dataclass(frozen=True)
class ExtractRecord:
    """Stage 02 (eagle3/stages/s02_extract/results.py `write_results`)."""

    STAGE: ClassVar[str] = "extract"
    target_model: str
    tokenizer_fingerprint: str
    aux_layer_ids: list  # docs/CONVENTIONS.md §1, resolved (the default is recorded as the ids it means)
    hidden_size: int
    num_layers: int
    vocab_size: int
    store_dtype: str  # eagle3/artifacts/store/format.py ENCODINGS
    complete: bool  # every file of every box is in
    missing_files: int
    missing_shard_indices: list


@dataclass(frozen=True)
class VocabRecord:
    """Stage 03 (eagle3/stages/s03_vocab/run.py `build_vocab_mapping`)."""

    STAGE: ClassVar[str] = "vocab"
    tokenizer_fingerprint: str
    target_vocab_size: int
    draft_vocab_size: int
    coverage_train: float  # share of the split's assistant tokens inside the draft vocab
    coverage_eval: float


@dataclass(frozen=True)
class TrainRecord:
    """Stage 04 (eagle3/stages/s04_train/run.py `Trainer.finish`)."""

    STAGE: ClassVar[str] = "train"
    ttt_steps: int  # draft steps unrolled in training: positions past it were never trained
    aux_layer_ids: list  # the store's, which the drafter was trained on
    steps: int
    best_step: int | None  # 0: no trained step beat the initial weights (--init-from); None: none evaluated
    best_expected_accept_length: float  # held-out, docs/CONVENTIONS.md §5
    best_eval: dict | None  # the held-out metrics at best_step (metrics.jsonl's eval row)
    best_checkpoint: str  # relative to 04_train/


@dataclass(frozen=True)
class ExportRecord:
    """Stage 05 (eagle3/stages/s05_export/run.py `write_report_and_manifest`)."""

    STAGE: ClassVar[str] = "export"
    drafter_dir: str
    drafter_files: dict  # file name -> sha256 (config.json, model.safetensors)
    aux_layer_ids: list
    checkpoint_step: int | None  # stage 04's step of the exported checkpoint (None: not recorded in it)
    expected_accept_length: float | None  # held-out, at that step; None when it was not evaluated


@dataclass(frozen=True)
class EvaluateRecord:
    """Stage 06 (eagle3/stages/s06_evaluate/run.py `evaluate_drafter`)."""

    STAGE: ClassVar[str] = "evaluate"
    drafter_dir: str
    target_model: str


Record = GenerateRecord | PrepareRecord | ExtractRecord | VocabRecord | TrainRecord | ExportRecord | EvaluateRecord

RECORDS: dict[str, type] = {cls.STAGE: cls for cls in (GenerateRecord, PrepareRecord, ExtractRecord, VocabRecord,
                                                       TrainRecord, ExportRecord, EvaluateRecord)}
assert set(RECORDS) == set(STAGE), "one record class per stage of the registry"


def record_from_json(stage: str, data: Any, path: Path | None) -> Record:
    """The record of `stage` from its manifest's `record` section, refused when it is not
    exactly the fields of its class (`path`: the manifest, named in the refusal)."""
    cls = RECORDS[stage]
    fix = f"rerun `python {STAGE[stage].script} --force` to rewrite it with this code"
    if not isinstance(data, dict):
        raise PipelineError(f"{path} has no record section (written by code older than the typed records of "
                            f"eagle3/artifacts/records.py); {fix}.")
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in data]
    unknown = sorted(set(data) - set(names))
    if missing or unknown:
        what = "; ".join(x for x in (f"lacks {missing}" if missing else "",
                                     f"holds unknown {unknown}" if unknown else "") if x)
        raise PipelineError(f"{path}: its {cls.__name__} {what} (written by another version of the code); {fix}.")
    return cls(**data)
