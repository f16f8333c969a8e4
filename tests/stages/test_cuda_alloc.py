"""Stage 04 on CUDA runs PyTorch's caching allocator with expandable segments unless the user
set its variables, and sets that before CUDA initialises, when torch reads it
(eagle3/stages/s04_train/cuda_alloc.py). No GPU here: the CUDA device is announced by a
patched `torch.cuda.is_available`, and the first CUDA initialisation is caught where every
CUDA use goes through it, `torch.cuda._lazy_init` (torch calls it from C++ on the first
tensor moved to a GPU, and `set_device` does), which records the environment and stops.
"""
import logging
import os

import pytest
import torch
from fixtures import copy_stages

from eagle3.stages.s04_train import cuda_alloc
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.cuda_alloc import ALLOC_CONF_VARS, alloc_conf_to_set, configure_cuda_allocator
from eagle3.stages.s04_train.run import train_drafter

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.fixture
def no_alloc_env(monkeypatch):
    """None of the allocator's variables set; whatever the test sets is undone after it."""
    for name in ALLOC_CONF_VARS:
        monkeypatch.setenv(name, "")  # recorded, so the teardown restores the variable as it was
        monkeypatch.delenv(name)


def test_the_setting_by_device_and_environment():
    assert alloc_conf_to_set(CUDA, {}) == "expandable_segments:True"
    assert alloc_conf_to_set(CUDA, {"OTHER": "1"}) == "expandable_segments:True"
    assert alloc_conf_to_set(CPU, {}) is None
    for name in ALLOC_CONF_VARS:  # the user's choice, whichever name, even empty (torch's defaults)
        assert alloc_conf_to_set(CUDA, {name: "max_split_size_mb:256"}) is None, name
        assert alloc_conf_to_set(CUDA, {name: ""}) is None, name


class CudaInit(Exception):
    pass


@pytest.mark.parametrize("user", [None, ("PYTORCH_ALLOC_CONF", "max_split_size_mb:256"),
                                  ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")])
def test_stage_04_sets_it_before_cuda_initialises(tmp_path, stages_123, tiny_llama, monkeypatch, no_alloc_env, user):
    if user:
        monkeypatch.setenv(*user)
    calls = []

    def is_available():
        calls.append(("is_available", os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
        return True

    def lazy_init():
        calls.append(("init", {name: os.environ.get(name) for name in ALLOC_CONF_VARS}))
        raise CudaInit

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)
    workdir = copy_stages(stages_123, tmp_path / "w")
    with pytest.raises(CudaInit):
        train_drafter(TrainConfig(work_dir=workdir, target_model=str(tiny_llama), device="cuda", max_steps=1,
                                  batch_tokens=1024, max_seq_len=256, ttt_steps=2, warmup_steps=1))
    inits = [seen for what, seen in calls if what == "init"]
    assert len(inits) == 1  # the first CUDA initialisation stopped the run
    want = {name: None for name in ALLOC_CONF_VARS}
    want.update([user] if user else [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")])
    assert inits[0] == want


def test_after_cuda_initialised_it_warns_and_changes_nothing(monkeypatch, no_alloc_env, caplog):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=cuda_alloc.__name__):
        configure_cuda_allocator(CUDA)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert "start the process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    configure_cuda_allocator(CPU)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # a CPU run leaves the environment alone
    configure_cuda_allocator(CUDA)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
