"""Stage 04's schedule and its training data: every step reads a batch of its own
epoch's packing that carries loss, and a train split where nothing carries loss is
refused before training.

Covers eagle3/stages/s04_train/data.py (EpochPlan, the packed leftover), eagle3/core/batching.py
(fold_leftover), eagle3/stages/s04_train/loss_positions.py and their use in eagle3/stages/s04_train/run.py.
Each epoch is shuffled and packed anew, so epochs differ in batch count; counting
every epoch's steps from epoch 0's packing made a step read past the end of a
shorter epoch (no sample: the optimizer and scheduler stepped on no gradient).
Stages 01-03 run once on 60 chats; the runs are a few steps long.
"""
import logging
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import copy_stages

from eagle3.artifacts.manifest import record_of
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.batching import fold_leftover, pack_greedy
from eagle3.core.errors import PipelineError
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.stages.s03_vocab.run import build_vocab_mapping
from eagle3.stages.s04_train import run as train_run
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.data import Batching, EpochPlan, epoch_batches
from eagle3.stages.s04_train.loss_positions import check_loss_positions, count_loss_positions

ROOT = Path(__file__).resolve().parents[2]
# On the 60 chats below, seed 8 and rows of 416 tokens pack epoch 1 into fewer rows
# than epoch 0 (the test checks it), both of the samples that carry loss and, as the
# schedule that counted every epoch's steps from epoch 0 did, of all samples: that
# schedule's last step read nothing.
RUN = dict(epochs=2, seed=8, batch_tokens=416, max_seq_len=256, ttt_steps=2, warmup_steps=2, learning_rate=2e-3,
           log_every=1, eval_every=1000, save_every=4)




def train_split(workdir: Path):
    return HiddenStateStore.open(WorkDir(workdir), needed_by="test").split("train")


def counted_by_hand(workdir: Path, max_seq_len: int) -> tuple[Counter, list[int]]:
    """The reasons of docs/CONVENTIONS.md §4, token by token from the store's samples:
    (counts by reason, loss-carrying positions per sample)."""
    t2d = torch.load(WorkDir(workdir).t2d(), weights_only=True).numpy()
    total, per_sample = Counter(), []
    for s in train_split(workdir):
        mask, amax = s.loss_mask.numpy(), s.target_argmax.numpy()
        carrying = 0
        for j in range(2, len(mask)):  # token j is predicted by drafter position j - 2
            if j >= max_seq_len:
                total["beyond_max_seq_len"] += 1
            elif not mask[j]:
                total["outside_mask"] += 1
            elif amax[j - 1] < 0 or not t2d[amax[j - 1]]:
                total["outside_vocab"] += 1
            else:
                carrying += 1
        total["carrying"] += carrying
        per_sample.append(carrying)
    return total, per_sample


# -- the schedule ----------------------------------------------------------------------
def test_fold_leftover_moves_the_last_row_only_when_all_of_it_fits():
    lengths = [5, 3, 8, 2, 1]
    rows = pack_greedy(range(5), lengths, 10)
    assert rows == [[0, 1], [2, 3], [4]]  # the last row: 1 token of 10
    assert fold_leftover(rows, lengths, 10) == [[0, 1, 4], [2, 3]]
    lengths = [7, 4, 5, 2, 1]
    rows = pack_greedy(range(5), lengths, 10)
    assert rows == [[0], [1, 2], [3, 4]]  # free space 3 and 1
    # longest first, each into the row with the least free space that holds it (the first on ties)
    assert fold_leftover(rows, lengths, 10) == [[0, 3, 4], [1, 2]]
    lengths = [5, 4, 8, 3, 1]
    rows = pack_greedy(range(5), lengths, 10)
    assert rows == [[0, 1], [2], [3, 4]]  # free space 1 and 2: sample 3 fits nowhere
    assert fold_leftover(rows, lengths, 10) is rows  # moving only sample 4 would leave a smaller last row


@pytest.mark.parametrize("world,grad_accum", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_epoch_plan_takes_each_epochs_steps_from_its_own_packing(world, grad_accum):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (200,), generator=g).tolist()
    cfg = Batching(batch_tokens=1024, max_seq_len=256, seed=1, packed=True)
    packings = [epoch_batches(lengths, cfg, e) for e in range(4)]
    assert len(packings[0]) > len(packings[1])  # the case that read past the end of epoch 1
    plans = [EpochPlan(lengths, cfg, rank=r, world=world, grad_accum=grad_accum) for r in range(world)]
    total = plans[0].steps_for_epochs(4)
    step = 0
    for e, batches in enumerate(packings):
        n = (len(batches) // world) // grad_accum
        assert all(p.steps_in(e) == n for p in plans)
        read = []
        for b in range(n):
            assert plans[0].locate(step) == (e, b)
            micro = [p.micro_batches(step) for p in plans]  # [rank][micro-batch]
            assert all(len(m) == grad_accum and all(m) for m in micro)  # never short, never empty
            read += [micro[r][a] for a in range(grad_accum) for r in range(world)]  # interleaved over ranks
            step += 1
        # the epoch's steps read its first n * W * A batches in order; only a remainder is skipped
        assert read == batches[:n * world * grad_accum]
    assert step == total


def test_the_packed_leftover_row_comes_last_in_its_epoch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (200,), generator=g).tolist()
    for seed in range(6):
        cfg = Batching(batch_tokens=1024, max_seq_len=256, seed=seed, packed=True)
        for e in range(3):
            batches = epoch_batches(lengths, cfg, e)
            sizes = [sum(min(lengths[i], 256) for i in b) for b in batches]
            # every row but the last is one greedy packing closed (or a leftover folded into it)
            assert min(sizes[:-1]) > 1024 - 256
            assert sorted(i for b in batches for i in b) == list(range(200))


def test_every_step_reads_its_own_epochs_packing_and_carries_loss(tmp_path, stages_123, tiny_llama, monkeypatch,
                                                                   caplog):
    a, b = copy_stages(stages_123, tmp_path / "a"), copy_stages(stages_123, tmp_path / "b")
    read, valid = {}, {}
    micro_batches, forward = train_run.Trainer.micro_batches, train_run.Trainer.forward

    def recording_micro_batches(self, step):
        read[step] = micro_batches(self, step)
        return read[step]

    def recording_forward(self, batch):
        out = forward(self, batch)
        if self.model.training:
            valid[self.step] = valid.get(self.step, 0) + out.metrics["num_valid"]
        return out

    monkeypatch.setattr(train_run.Trainer, "micro_batches", recording_micro_batches)
    monkeypatch.setattr(train_run.Trainer, "forward", recording_forward)
    with caplog.at_level(logging.INFO):
        m = train_run.train_drafter(TrainConfig(work_dir=a, target_model=str(tiny_llama), **RUN))
    total = record_of(m).steps
    # Every step read a batch whose positions carry loss.
    assert sorted(valid) == list(range(total)), f"steps without a sample: {set(range(total)) - set(valid)}"
    assert all(valid[s] > 0 for s in range(total)), {s: v for s, v in valid.items() if v == 0}

    # Each epoch has the steps of its own packing (of the samples that carry loss), and
    # its steps read exactly that packing's batches; this data packs into unequal epochs.
    by_hand, per_sample = counted_by_hand(a, RUN["max_seq_len"])
    trainable = [i for i, c in enumerate(per_sample) if c > 0]
    lengths = train_split(a).lengths()
    cfg = Batching(RUN["batch_tokens"], RUN["max_seq_len"], RUN["seed"])
    packings = [[[trainable[i] for i in batch] for batch in epoch_batches([lengths[i] for i in trainable], cfg, e)]
                for e in range(RUN["epochs"])]
    assert m.counts["steps_per_epoch"] == [len(p) for p in packings]
    assert len(packings[0]) > len(packings[1])  # the shape of the defect: a shorter second epoch
    assert [read[s][0] for s in range(total)] == packings[0] + packings[1]
    # An epoch reads every sample that carries loss once, so its steps carry all the
    # positions counted before training, by the trainer's own rule (eagle3/drafter/ttt.py).
    assert sum(valid[s] for s in range(len(packings[0]))) == by_hand["carrying"]
    assert m.counts["loss_positions"]["carrying"] == by_hand["carrying"]
    # The tiny target's argmax is outside the 128-token draft vocab at most assistant
    # positions: the run warns with the counts.
    assert "more than half of the train split carries no loss" in caplog.text
    assert f"{by_hand['outside_vocab']} with the target's argmax outside the draft vocabulary" in caplog.text

    # Killed in epoch 1 and resumed: the checkpoint's data position maps to the right
    # epoch and step, and the run ends where the unbroken one did, bitwise.
    monkeypatch.setattr(train_run.Trainer, "micro_batches", micro_batches)
    monkeypatch.setattr(train_run.Trainer, "forward", forward)
    assert train_run.train_drafter(TrainConfig(work_dir=b, target_model=str(tiny_llama), stop_after=13, **RUN)) is None
    ckpt = torch.load(WorkDir(b).checkpoint(12), weights_only=True)  # the last one saved (every 4 steps)
    n0 = len(packings[0])
    assert n0 < 12 and (ckpt["epoch"], ckpt["batch_in_epoch"]) == (1, 12 - n0)  # steps of epoch 1 done
    mb = train_run.train_drafter(TrainConfig(work_dir=b, target_model=str(tiny_llama), **RUN))
    assert record_of(mb).steps == total
    wa = torch.load(WorkDir(a).checkpoint(total), weights_only=True)["model"]
    wb = torch.load(WorkDir(b).checkpoint(total), weights_only=True)["model"]
    for k in wa:  # the same computation replayed from the checkpoint
        assert torch.equal(wa[k], wb[k]), k


# -- no loss-carrying position: refused before training ---------------------------------
def test_counts_match_a_token_by_token_count(stages_123):
    t2d = torch.load(WorkDir(stages_123).t2d(), weights_only=True)
    for max_seq_len in (256, 40):
        c = count_loss_positions(train_split(stages_123), t2d, max_seq_len)
        by_hand, per_sample = counted_by_hand(stages_123, max_seq_len)
        assert (c.beyond_max_seq_len, c.outside_mask, c.outside_vocab, c.carrying) == (
            by_hand["beyond_max_seq_len"], by_hand["outside_mask"], by_hand["outside_vocab"], by_hand["carrying"])
        assert c.per_sample.tolist() == per_sample
        assert c.positions == sum(max(n - 2, 0) for n in train_split(stages_123).lengths())
    # Cropped at 40 tokens, most answers fall beyond the crop: the warning, with these counts.
    warning = check_loss_positions(c, max_seq_len=40, draft_vocab=128, mapping_from="x")
    dropped = c.assistant - c.carrying
    assert 2 * c.samples_without_loss > c.samples or 2 * dropped > c.assistant
    assert warning.startswith(f"{c.source}: more than half of the train split carries no loss "
                              f"({c.samples_without_loss} of {c.samples} samples, {dropped} of {c.assistant} "
                              f"assistant positions) [{c.summary(40, 128)}]; ")
    assert warning.endswith("Raise --max-seq-len, or the draft vocabulary in stage 03, to train on more of the data")


def test_answers_beyond_max_seq_len_exit_with_one_line_naming_the_store_and_counts(tmp_path, stages_123,
                                                                                   tiny_llama):
    workdir = copy_stages(stages_123, tmp_path / "w")
    by_hand, _ = counted_by_hand(workdir, 16)  # every chat's prompt is longer than 16 tokens
    assert by_hand["carrying"] == 0 and by_hand["outside_vocab"] == 0
    r = subprocess.run([sys.executable, str(ROOT / "04_train_drafter.py"), "--work-dir", str(workdir), "--target-model",
                        str(tiny_llama), "--max-seq-len", "16", "--batch-tokens", "512", "--max-steps", "1",
                        "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d E ", line)]  # eagle3/core/logs.py
    assert len(errors) == 1, r.stderr[-3000:]
    line = errors[0]
    assert f"{WorkDir(workdir).store()}: no position of the train split carries loss" in line
    assert (f"{sum(by_hand.values())} predicted positions: {by_hand['beyond_max_seq_len']} beyond --max-seq-len "
            f"16, {by_hand['outside_mask']} outside the assistant mask, 0 with the target's argmax outside the "
            f"draft vocabulary of 128 tokens, 0 carrying loss") in line
    assert "every assistant token lies beyond --max-seq-len 16: raise --max-seq-len" in line
    assert not WorkDir(workdir).checkpoints().exists()


def test_a_draft_vocab_without_the_targets_predictions_is_refused_before_training(tmp_path, stages_123,
                                                                                   tiny_llama):
    workdir = WorkDir(copy_stages(stages_123, tmp_path / "w"))
    predicted = np.unique(np.concatenate([s.target_argmax.numpy() for s in train_split(workdir.root)]))
    freq = np.load(workdir.token_freq("train"))
    # frequencies that make stage 03 choose 16 ids the target never predicts on the train split
    fake = np.zeros_like(freq)
    fake[np.setdiff1d(np.arange(len(freq)), predicted)[:16]] = 1
    np.save(workdir.token_freq("train"), fake)
    build_vocab_mapping(VocabConfig(work_dir=workdir.root, draft_vocab_size=16, force=True))
    by_hand, _ = counted_by_hand(workdir.root, 256)
    assert by_hand["carrying"] == 0 and by_hand["outside_vocab"] > 0
    with pytest.raises(PipelineError) as e:
        train_run.train_drafter(TrainConfig(work_dir=workdir.root, target_model=str(tiny_llama), max_steps=1,
                                       **{k: v for k, v in RUN.items() if k != "epochs"}))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{workdir.store()}: no position of the train split carries loss" in msg
    assert (f"{by_hand['outside_mask']} outside the assistant mask, {by_hand['outside_vocab']} with the target's "
            f"argmax outside the draft vocabulary of 16 tokens, 0 carrying loss") in msg
    assert f"the draft vocabulary ({workdir.d2t()}) never holds the target's prediction" in msg
    assert not workdir.checkpoints().exists() and not workdir.train_metrics().exists()
