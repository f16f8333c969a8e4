"""Stage 02's file plan: which files the store holds, and which of them a box writes.

Each split is cut into files of `samples_per_file` consecutive samples, numbered train first,
then eval; box `shard_index` of `num_shards` takes every `num_shards`-th file. The plan depends
only on the sample counts and `samples_per_file`, so boxes run separately write exactly the
files one run would. Pure: no file is read or written here.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle3.artifacts import store
from eagle3.artifacts.workdir import SPLITS


@dataclass(frozen=True)
class FileSpec:
    """One store file: `count` samples of `split` starting at sample `first`."""

    split: str
    file_no: int
    first: int
    count: int

    @property
    def name(self) -> str:
        return store.file_name(self.split, self.file_no)


def plan_files(num_samples: dict[str, int], samples_per_file: int) -> list[FileSpec]:
    """All files of the store, train first: the same list on every box."""
    plan = []
    for split in SPLITS:
        n = num_samples.get(split, 0)
        for k, a in enumerate(range(0, n, samples_per_file)):
            plan.append(FileSpec(split, k, a, min(samples_per_file, n - a)))
    return plan


def box_files(plan: list[FileSpec], num_shards: int, shard_index: int) -> list[FileSpec]:
    """The files box `shard_index` of `num_shards` writes: every num_shards-th of the plan."""
    return plan[shard_index::num_shards]
