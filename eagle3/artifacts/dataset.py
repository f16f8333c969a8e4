"""Stage 01's outputs on disk: the tokenized splits and their token counts, each with one
writer and one reader.

A split is a `datasets` Arrow folder (01_dataset/train/, 01_dataset/eval/) with the
columns below; stage 02 reads it back to run the target on exactly these token ids.
`token_freq_{split}.npy` counts each target id among the split's assistant (loss) tokens,
int64 [target_vocab]: stage 03 chooses the draft vocabulary from it, stage 05 and
`diagnose` report coverage with it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3.artifacts.atomic import atomic_path, save_numpy
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError


def split_features():
    import datasets

    return datasets.Features({
        "sample_id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
    })


def save_split(path: Path, sample_ids: list[str], input_ids: list, loss_masks: list) -> None:
    """Write one split (atomically: a killed run leaves no folder that looks finished)."""
    import datasets

    ds = datasets.Dataset.from_dict({
        "sample_id": sample_ids,
        "input_ids": input_ids,
        "loss_mask": loss_masks,
        "num_tokens": [len(x) for x in input_ids],
    }, features=split_features())
    with atomic_path(path) as tmp:
        ds.save_to_disk(str(tmp))


def load_split(path: Path):
    """A split written by stage 01. `datasets` cannot read back a saved split with
    zero rows (e.g. --eval-fraction 0), so an empty one is rebuilt in memory."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except IndexError:
        return datasets.Dataset.from_dict({k: [] for k in split_features()}, features=split_features())


def save_token_freq(workdir: WorkDir, split: str, freq: np.ndarray) -> Path:
    save_numpy(workdir.token_freq(split), np.asarray(freq, dtype=np.int64))
    return workdir.token_freq(split)


def load_token_freq(workdir: WorkDir, split: str) -> np.ndarray:
    """int64 [target_vocab] of `split`; callers check the width against their target."""
    f = workdir.token_freq(split)
    if not f.is_file():
        raise PipelineError(f"{f} does not exist; run `python {WorkDir.script('prepare')}` first.")
    return np.load(f)
