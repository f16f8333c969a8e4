"""The draft vocabulary's arithmetic and files (eagle3/artifacts/vocab_map.py): coverage, the d2t
offsets and their inverse for numpy and torch, `compare_mappings`, and stage 03's files
written by `save_mapping` and read back by `load_mapping` (or refused naming the fix)."""
import numpy as np
import pytest
import torch

from eagle3.artifacts.vocab_map import (VocabMapping, compare_mappings, coverage, d2t_from_ids, load_mapping,
                                        save_mapping, target_ids)
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError


def test_coverage_hand_computed():
    freq = np.array([10, 0, 5, 5, 80])
    t2d = np.array([True, True, False, False, True])
    assert coverage(freq, t2d) == pytest.approx(90 / 100)
    assert np.isnan(coverage(np.zeros(5, dtype=np.int64), t2d))  # nothing counted: undefined, not 0 or 1


def test_target_ids_and_offsets_invert_each_other_in_numpy_and_torch():
    ids = [3, 4, 9, 20]
    d2t = d2t_from_ids(np.array(ids))
    assert d2t.dtype == np.int64 and d2t.tolist() == [3, 3, 7, 17]
    assert target_ids(d2t).tolist() == ids and target_ids(d2t.astype(np.int32)).dtype == np.int64
    t = d2t_from_ids(torch.tensor(ids, dtype=torch.int32))
    assert t.dtype == torch.int64 and t.tolist() == [3, 3, 7, 17]
    got = target_ids(t.to(torch.int32))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.tolist() == ids
    assert target_ids(torch.zeros(2, 2, dtype=torch.int64)).tolist() == [0, 1, 2, 3]  # flattened, identity


def test_compare_mappings_counts_positions_and_tokens():
    a = VocabMapping("a", np.array([1, 2, 5, 7]), 10)
    b = VocabMapping("b", np.array([1, 3, 5]), 10)
    r = compare_mappings(a, b)
    assert a.draft_vocab_size == 4 and b.draft_vocab_size == 3
    # position 1 differs (2 vs 3), position 3 exists only in a
    assert (r["positions_compared"], r["positions_differing"]) == (4, 2)
    assert (r["tokens_shared"], r["only_in_a"], r["only_in_b"]) == (2, 2, 1)
    assert r["a"] == {"source": "a", "draft_vocab_size": 4, "vocab_size": 10}
    assert compare_mappings(a, a)["positions_differing"] == 0


def test_saved_mapping_loads_back_as_written(tmp_path):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("vocab").mkdir(parents=True)
    d2t = np.array([1, 1, 3], dtype=np.int64)
    t2d = np.array([False, True, True, False, False, True, False])
    files = save_mapping(workdir, d2t, t2d)
    assert files and all(f.is_file() for f in files)
    got_d2t, got_t2d = load_mapping(workdir)
    assert got_d2t.dtype == torch.int64 and got_d2t.tolist() == [1, 1, 3]
    assert got_t2d.dtype == torch.bool and got_t2d.tolist() == t2d.tolist()


def test_a_missing_mapping_names_the_file_and_the_stage_to_run(tmp_path):
    workdir = WorkDir(tmp_path)
    with pytest.raises(PipelineError, match=r"d2t\.pt does not exist; run `python 03_build_vocab_mapping\.py` first"):
        load_mapping(workdir)
