"""Stage 03's pure core (eagle3/stages/s03_vocab/run.py): which target ids make the draft
vocabulary (docs/CONVENTIONS.md §2) and the d2t / t2d arrays built from them. The stage
on the tiny Llama: tests/stages/test_vocab.py."""
import numpy as np
import pytest

from eagle3.stages.s03_vocab.run import mapping_from_ids, select_draft_ids


def test_top_k_with_ties_to_lower_id_sorted():
    freq = np.array([0, 5, 3, 5, 3, 9, 0, 3])
    # 9@5, 5@1, 5@3, then a tie of 3s at 2, 4, 7 -> lower ids first
    assert select_draft_ids(freq, 4).tolist() == [1, 2, 3, 5]
    assert select_draft_ids(freq, 5).tolist() == [1, 2, 3, 4, 5]


def test_padding_with_lowest_unused_ids():
    freq = np.array([0, 0, 7, 0, 1, 0, 0, 2])
    assert select_draft_ids(freq, 5).tolist() == [0, 1, 2, 4, 7]  # seen {2,4,7} + unused {0,1}


def test_mapping_invariants():
    freq = np.random.default_rng(0).poisson(2.0, size=1000)
    ids = select_draft_ids(freq, 100)
    d2t, t2d = mapping_from_ids(ids, 1000)
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    assert np.array_equal(d2t + np.arange(100), ids) and np.array_equal(np.flatnonzero(t2d), ids)
    assert t2d.sum() == 100 and np.all(d2t >= 0) and np.all(np.diff(d2t) >= 0)


def test_mapping_by_hand_and_unsorted_ids_refused():
    d2t, t2d = mapping_from_ids(np.array([1, 2, 5]), 7)
    assert d2t.tolist() == [1, 1, 3] and t2d.tolist() == [False, True, True, False, False, True, False]
    with pytest.raises(AssertionError, match="strictly ascending"):
        mapping_from_ids(np.array([2, 1]), 7)
