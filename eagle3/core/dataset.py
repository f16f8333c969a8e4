"""Stage 01's tokenized splits on disk: their columns, and the one reader later stages use.

A split is a `datasets` Arrow folder (01_dataset/train/, 01_dataset/eval/) with the
columns below; stage 02 reads it back to run the target on exactly these token ids.
"""
from __future__ import annotations

from pathlib import Path


def split_features():
    import datasets

    return datasets.Features({
        "sample_id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
    })


def load_split(path: Path):
    """A split written by stage 01. `datasets` cannot read back a saved split with
    zero rows (e.g. --eval-fraction 0), so an empty one is rebuilt in memory."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except IndexError:
        return datasets.Dataset.from_dict({k: [] for k in split_features()}, features=split_features())
