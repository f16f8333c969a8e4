"""Stage 04's background loader (eagle3/stages/s04_train/data.py `Prefetcher`): it reads
ahead of the step, in the step's order, hands a worker error to the training thread
naming the store file, stops on close; training with it gives the weights of loading in
the training thread, bitwise, on an fp8 store (whose states a GPU run decodes on the
device: `decode_states`, checked here against the reader's CPU decode)."""
import threading
import time

import pytest
import torch
from fixtures import copy_stages

from eagle3.artifacts.store import HiddenStateStore, decode_states
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train import run as train_run
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.data import Batching, EpochPlan, Prefetcher, load_batch

PLAN = dict(rank=0, world=1, grad_accum=2)


def _plan() -> EpochPlan:
    return EpochPlan([10] * 24, Batching(batch_tokens=20, max_seq_len=10, seed=3), **PLAN)  # 6 steps an epoch


def _wait(cond, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stage04-prefetch"]


def test_loader_reads_ahead_of_the_step_in_its_order_and_no_further_than_its_depth():
    plan, loads = _plan(), []

    def load(idx):
        loads.append(list(idx))
        return {"idx": torch.tensor(idx)}

    pf = Prefetcher(load, plan, start=1, total=6, depth=3, pin=False, files=lambda idx: [])
    try:
        # Before the training thread asks for anything, the loader has read `depth` batches ahead...
        _wait(lambda: pf.loaded == 3)
        time.sleep(0.2)
        assert pf.loaded == 3  # ...and waits there: the queue bounds its memory
        got = []
        for step in range(1, 6):
            for i in range(2):
                got.append(pf.get(step, i)["idx"].tolist())
                _wait(lambda: pf.loaded >= min(10, len(got) + 3))  # it keeps `depth` ahead
        sync = [m for step in range(1, 6) for m in plan.micro_batches(step)]
        assert got == sync == loads  # the order of loading in the training thread, resumed at step 1
    finally:
        pf.close()


def test_a_worker_error_is_raised_in_the_training_thread_naming_the_file():
    plan = _plan()
    bad = plan.micro_batches(2)[1]

    def load(idx):
        if idx == bad:
            raise OSError(5, "Input/output error")
        return {"idx": torch.tensor(idx)}

    pf = Prefetcher(load, plan, start=0, total=6, depth=2, pin=False,
                    files=lambda idx: [f"train-{min(idx) // 8:05d}.safetensors"])
    try:
        for step, i in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]:
            assert pf.get(step, i)["idx"].tolist() == plan.micro_batches(step)[i]
        with pytest.raises(PipelineError, match=rf"loader .* failed loading micro-batch 1 of step 2 from "
                                                rf"train-0000{min(bad) // 8}\.safetensors in the store: OSError: "
                                                rf".*Input/output error") as e:
            pf.get(2, 1)
        assert isinstance(e.value.__cause__, OSError)
    finally:
        pf.close()
    assert not _loader_threads()


def test_close_stops_a_loader_waiting_on_a_full_queue():
    pf = Prefetcher(lambda idx: {"idx": torch.tensor(idx)}, _plan(), start=0, total=6, depth=1, pin=False,
                    files=lambda idx: [])
    _wait(lambda: pf.loaded == 1)
    pf.close()
    assert not _loader_threads()


# -- on a real fp8 store -------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_stages(stage_runs, tiny_llama):
    return stage_runs(tiny_llama, chats=40, extract=dict(store_dtype="fp8"))


@pytest.mark.parametrize("packed", [True, False])
def test_states_decoded_where_the_batch_goes_equal_the_readers_decode(fp8_stages, packed):
    split = HiddenStateStore.open(WorkDir(fp8_stages), needed_by="test").split("train")
    idx = [0, 3, 5]
    enc = load_batch(split, idx, 64, packed=packed, decode=False)
    assert enc["aux"].dtype == torch.float8_e4m3fn and "scale_log2" in enc
    ref = load_batch(split, idx, 64, packed=packed)
    got = decode_states(enc)
    assert got.keys() == ref.keys()
    for k in ref:  # e4m3 code x 2**e is exact in float32 and bf16: the same values, whichever path
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k


def test_training_with_the_loader_equals_loading_in_the_training_thread(tmp_path, fp8_stages, tiny_llama,
                                                                        monkeypatch):
    run = dict(target_model=str(tiny_llama), max_steps=4, batch_tokens=256, max_seq_len=128, grad_accum=2, ttt_steps=2,
               warmup_steps=1, learning_rate=2e-3, log_every=1, eval_every=1000, save_every=1000, aux_noise=0.05)
    weights = {}
    for prefetch in (0, 2):
        workdir = copy_stages(fp8_stages, tmp_path / f"p{prefetch}")
        train_run.train_drafter(TrainConfig(work_dir=workdir, prefetch=prefetch, **run))
        weights[prefetch] = torch.load(WorkDir(workdir).checkpoint(4), map_location="cpu", weights_only=True)["model"]
    assert weights[0].keys() == weights[2].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[2][k]), k
    assert not _loader_threads()

    # Ctrl-C in the middle of a step: the loader thread is stopped, not left behind.
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_run.Trainer, "train_step", interrupted)
    workdir = copy_stages(fp8_stages, tmp_path / "ctrl-c")
    with pytest.raises(KeyboardInterrupt):
        train_run.train_drafter(TrainConfig(work_dir=workdir, prefetch=2, **run))
    assert not _loader_threads()
