"""Stage 04 stops before damage: a non-finite loss or gradient, or a full disk.

A NaN/inf loss or gradient norm stops the run before the optimizer step (the weights
are those of the last good step, no checkpoint of the bad step is written), and a
full disk while appending to metrics.jsonl stops it with the path and the bytes;
in both cases the same command, rerun, resumes from the last checkpoint. The faults
are injected: the loss or its gradient is poisoned at one step through a wrapped
`Trainer.forward`, and the metrics file's write raises ENOSPC halfway through a line.

Cost: about 25 s on 2 cores (stages 01-03 once on 60 chats, then runs of 6 steps).
"""
import builtins
import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from fixtures import copy_stages

from eagle3.artifacts.atomic import DiskFullError
from eagle3.artifacts.manifest import record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.drafter.ttt import TTTOutput
from eagle3.stages.s04_train import metrics
from eagle3.stages.s04_train import run as train_run
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.metrics import read_lines_up_to

RUN = dict(max_steps=6, batch_tokens=1024, max_seq_len=256, ttt_steps=2, warmup_steps=2, learning_rate=2e-3,
           log_every=1, eval_every=1000, save_every=2)
BAD_STEP = 3  # the step the fault hits; the last checkpoint before it is step 2




def config(workdir: Path, tiny_llama: Path) -> TrainConfig:
    return TrainConfig(work_dir=workdir, target_model=str(tiny_llama), **RUN)


def saved_steps(workdir: WorkDir) -> list[int]:
    return sorted(s for s in map(workdir.checkpoint_step, workdir.checkpoints().iterdir()) if s is not None)


def train_steps_logged(workdir: WorkDir) -> list[int]:
    rows = [json.loads(line) for line in workdir.train_metrics().read_text().splitlines()]
    return [r["step"] for r in rows if r["split"] == "train"]


class NaNGrad(torch.autograd.Function):
    """Identity forward (the loss stays finite); NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


POISONS = {
    "nan_loss": (lambda loss: loss * float("nan"), r"non-finite loss nan at step 3"),
    "inf_loss": (lambda loss: loss + float("inf"), r"non-finite loss inf at step 3"),
    "nan_grad": (NaNGrad.apply, r"non-finite gradient norm at step 3"),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_non_finite_loss_or_gradient_stops_before_the_optimizer_step(poison, tmp_path, stages_123, tiny_llama,
                                                                      monkeypatch):
    workdir = WorkDir(copy_stages(stages_123, tmp_path / "w"))
    make_bad, message = POISONS[poison]
    seen = {}
    forward = train_run.Trainer.forward

    def poisoned_forward(self, batch):
        out = forward(self, batch)
        if not (self.model.training and self.step == BAD_STEP):
            return out
        seen["trainer"] = self
        seen["weights"] = {k: v.clone() for k, v in self.drafter.state_dict().items()}  # before this step
        return TTTOutput(loss=make_bad(out.loss), metrics=out.metrics)

    monkeypatch.setattr(train_run.Trainer, "forward", poisoned_forward)
    with pytest.raises(PipelineError, match=message):
        train_run.train_drafter(config(workdir.root, tiny_llama))

    trainer = seen["trainer"]
    after = trainer.drafter.state_dict()
    for k, v in seen["weights"].items():
        assert torch.equal(after[k], v), k  # no update at all: the same tensors, bitwise
    assert trainer.sched.last_epoch == BAD_STEP  # three scheduler steps, not four
    assert {int(s["step"]) for s in trainer.opt.state.values()} == {BAD_STEP}  # AdamW's own step count
    if poison == "nan_grad":  # the poison did reach the gradients that were not applied
        assert any(p.grad is not None and p.grad.isnan().any() for p in trainer.params)
    assert saved_steps(workdir) == [2]  # no checkpoint of the bad step (nor of step 4)
    assert json.loads(workdir.latest_checkpoint().read_text())["step"] == 2
    assert not workdir.manifest("train").exists()

    monkeypatch.setattr(train_run.Trainer, "forward", forward)  # the cause is gone: the same command resumes
    m = train_run.train_drafter(config(workdir.root, tiny_llama))
    assert record_of(m).steps == 6
    assert train_steps_logged(workdir) == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_at_the_metrics_stops_the_stage_and_a_rerun_resumes(tmp_path, stages_123, tiny_llama,
                                                                         monkeypatch):
    a, b = WorkDir(copy_stages(stages_123, tmp_path / "a")), WorkDir(copy_stages(stages_123, tmp_path / "b"))
    train_run.train_drafter(config(b.root, tiny_llama))  # unbroken

    attempted = []

    class FillsUpAtStep4:
        """A file whose write of step 4's train line stores half of it, then hits ENOSPC."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data: bytes):
            row = json.loads(data)
            if row["split"] == "train" and row["step"] == 4:
                attempted.append(len(data))
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return FillsUpAtStep4(f) if "a" in mode else f

    monkeypatch.setattr(metrics, "open", full_disk_open, raising=False)
    with pytest.raises(DiskFullError) as e:
        train_run.train_drafter(config(a.root, tiny_llama))
    msg = str(e.value)
    assert f"writing {a.train_metrics()}" in msg
    assert int(re.search(r"it needs ([\d,]+) bytes", msg).group(1).replace(",", "")) == attempted[0] > 0
    assert train_steps_logged(a) == [1, 2, 3]  # the torn half line was cut off again
    assert saved_steps(a) == [2] and not a.manifest("train").exists()

    monkeypatch.setattr(metrics, "open", builtins.open)  # space freed: the same command resumes from step 2
    m = train_run.train_drafter(config(a.root, tiny_llama))
    assert record_of(m).steps == 6
    assert train_steps_logged(a) == [1, 2, 3, 4, 5, 6]
    wa = torch.load(a.checkpoint(6), weights_only=True)["model"]
    wb = torch.load(b.checkpoint(6), weights_only=True)["model"]
    for k in wb:  # the same computation replayed from the checkpoint: bitwise
        assert torch.equal(wa[k], wb[k]), k


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"split": "train", "step": 1}\n{"split": "eval", "step": 2}\n'
                    '{"split": "train", "step": 3}\n{"split": "tra')
    assert read_lines_up_to(path, 2) == ['{"split": "train", "step": 1}', '{"split": "eval", "step": 2}']
    assert len(read_lines_up_to(path, 10)) == 3
