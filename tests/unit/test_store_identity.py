"""The store's identity has one source, store.json; index.json names it by its hash
(eagle3/artifacts/store/format.py), and the store package re-exports what the one module had."""
import json

import pytest
import torch

from eagle3.artifacts import store
from eagle3.artifacts.manifest import sha256_json, write_manifest
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

H, LAYERS = 8, [1, 2, 3]
IDENTITY = {"store_format": store.STORE_FORMAT, "aux_layers": LAYERS, "hidden_size": H, "num_layers": 5,
            "vocab_size": 50, "tokenizer_fingerprint": "t", "target_model": "m", **store.identity_fields("bf16")}


def _store(root, edit_index=None, drop_identity=False) -> WorkDir:
    """A one-file store with stage 02's manifest; `edit_index(index)` rewrites index.json first."""
    workdir = WorkDir(root)
    d = workdir.store()
    h = sha256_json(IDENTITY)  # what stage 02 records in every file header and index entry
    partial = d / store.partial_name("train", 0)
    lay = store.create_partial_file(partial, split="train", file_no=0, first_sample=0, input_ids=[[1, 2, 3]],
                                    loss_masks=[[1, 1, 1]], hidden_size=H, aux_layers=LAYERS, identity_hash=h)
    store.write_sample_states(partial, 0, torch.ones(3, 3, H), torch.ones(3, H), lay)
    entry = store.finalize_file(partial, d / store.file_name("train", 0), split="train", file_no=0, first_sample=0,
                                sample_ids=["a"], identity_hash=h, normalize=lambda x: x,
                                argmax=lambda x: torch.zeros(x.shape[0], dtype=torch.int64))
    path = store.write_index(d, IDENTITY, [entry], {"train": 1}, samples_per_file=1)
    if edit_index:
        path.write_text(json.dumps(edit_index(json.loads(path.read_text()))))
    if drop_identity:
        (d / store.STORE_JSON).unlink()
    write_manifest(workdir, "extract", params={}, inputs={}, counts={}, outputs=[d], record=None, hash_outputs=False)
    return workdir


def test_index_names_the_identity_by_its_hash_and_store_json_is_the_identity(tmp_path):
    workdir = _store(tmp_path)
    index = json.loads((workdir.store() / store.INDEX_JSON).read_text())
    assert "identity" not in index and index["identity_hash"] == sha256_json(IDENTITY)
    assert json.loads((workdir.store() / store.STORE_JSON).read_text()) == IDENTITY
    s = store.HiddenStateStore.open(workdir, needed_by="test")
    assert s.index["identity"] == IDENTITY and s.aux_layers == LAYERS and s.hidden_size == H


def test_an_index_of_earlier_code_with_a_copy_of_the_identity_still_opens(tmp_path):
    workdir = _store(tmp_path, lambda index: {"store_format": index["store_format"], "identity": IDENTITY,
                                         "splits": index["splits"]})
    assert store.HiddenStateStore.open(workdir, needed_by="test").split("train")[0].input_ids.tolist() == [1, 2, 3]


@pytest.mark.parametrize("how", ["hash", "copy"])
def test_an_index_of_another_identity_is_refused_naming_both_files(tmp_path, how):
    other = {**IDENTITY, "hidden_size": 16}

    def edit(index):
        if how == "hash":
            index["identity_hash"] = sha256_json(other)
        else:
            del index["identity_hash"]
            index["identity"] = other
        return index

    workdir = _store(tmp_path, edit)
    with pytest.raises(PipelineError, match=r"stage 04: .*index\.json holds .*, not that of .*store\.json .*two "
                                            r"stores.*Rerun `python 02_extract_hidden_states\.py`"):
        store.HiddenStateStore.open(workdir, needed_by="stage 04")


def test_a_store_without_its_identity_is_refused(tmp_path):
    workdir = _store(tmp_path, drop_identity=True)
    with pytest.raises(PipelineError, match=r"store\.json, the store's identity, is missing.*--force"):
        store.HiddenStateStore.open(workdir, needed_by="stage 04")


def test_the_package_exports_every_name_of_its_modules():
    from eagle3.artifacts.store import format, reader, writer

    for mod in (format, writer, reader):
        for name in mod.__all__:
            assert getattr(store, name) is getattr(mod, name), name
