"""A resume loads its checkpoint memory-mapped (eagle3/artifacts/train_outputs.py:read_checkpoint),
so the ranks of a torchrun resume share one copy of the file instead of holding one each,
and the resumed run is still bitwise the unbroken one.

"Mapped" is checked where it shows: every loaded tensor's memory lies inside a mapping of
the checkpoint file in /proc/self/maps (a plain load puts it in anonymous memory).
"""
import json
from pathlib import Path

import pytest
import torch
from fixtures import copy_stages, train_checkpoint

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train import checkpoint
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter


def file_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from `path` (/proc/self/maps)."""
    target, out = str(Path(path).resolve()), []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def mapped_share(obj, path: Path) -> tuple[int, int]:
    """(tensors whose bytes lie in a mapping of `path`, tensors) among the non-empty ones."""
    ranges = file_ranges(path)
    ts = [t for t in tensors(obj) if t.numel() > 0]
    inside = sum(any(lo <= t.data_ptr() and t.data_ptr() + t.untyped_storage().nbytes() <= hi for lo, hi in ranges)
                 for t in ts)
    return inside, len(ts)


def test_a_checkpoint_is_loaded_mapped_from_its_file(tmp_path):
    workdir = WorkDir(tmp_path)
    g = torch.Generator().manual_seed(0)
    ckpt = train_checkpoint({"w": torch.randn(256, 64, generator=g), "d2t": torch.arange(8)}, {},
                            optimizer={"state": {0: {"step": torch.tensor(2.0),
                                                     "exp_avg": torch.randn(256, 64, generator=g)}}})
    path = checkpoint.save_checkpoint(workdir, ckpt, keep=2, is_best=False)
    plain = torch.load(path, map_location="cpu", weights_only=True)
    assert mapped_share(plain, path) == (0, 5)  # the check tells a plain load from a mapped one
    loaded = checkpoint.read_checkpoint(path)
    assert mapped_share(loaded.to_file(), path) == (5, 5)
    assert torch.equal(loaded.model["w"], ckpt.model["w"])
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], ckpt.optimizer["state"][0]["exp_avg"])
    # writes go to private pages, never to the file
    loaded.model["w"].zero_()
    assert torch.equal(torch.load(path, map_location="cpu", weights_only=True)["model"]["w"], ckpt.model["w"])


def test_a_mapped_resume_equals_the_unbroken_run(tmp_path, stages_123, tiny_llama, monkeypatch):
    """Killed after step 3, resumed from step 2's mapped file; keep_checkpoints=1 deletes that
    file at step 4 while the resumed optimizer still holds pages of it."""
    seen = []
    real = checkpoint.read_checkpoint

    def spy(path):
        ckpt = real(path)
        seen.append(mapped_share(ckpt.to_file(), path))
        return ckpt

    monkeypatch.setattr(checkpoint, "read_checkpoint", spy)
    a, b = copy_stages(stages_123, tmp_path / "a"), copy_stages(stages_123, tmp_path / "b")
    cfg = dict(target_model=str(tiny_llama), device="cpu", max_steps=4, batch_tokens=512, max_seq_len=256, ttt_steps=2,
               warmup_steps=1, learning_rate=2e-3, log_every=1, eval_every=1000, save_every=2, keep_checkpoints=1)
    train_drafter(TrainConfig(work_dir=b, **cfg))
    assert train_drafter(TrainConfig(work_dir=a, stop_after=3, **cfg)) is None
    assert json.loads(WorkDir(a).latest_checkpoint().read_text())["step"] == 2
    assert seen == []
    train_drafter(TrainConfig(work_dir=a, **cfg))
    assert len(seen) == 1 and seen[0][0] == seen[0][1] > 10, seen  # weights, moments, steps, RNG: all mapped
    assert not WorkDir(a).checkpoint(2).exists()  # deleted under the resumed run
    wa, wb = (torch.load(WorkDir(w).checkpoint(4), map_location="cpu", weights_only=True) for w in (a, b))
    for part in ("model", "optimizer"):
        xa, xb = list(tensors(wa[part])), list(tensors(wb[part]))
        assert len(xa) == len(xb) > 0
        for x, y in zip(xa, xb):
            assert torch.equal(x, y), part
    assert wa["step"] == wb["step"] == 4


def test_a_file_torch_cannot_map_is_refused_by_name(tmp_path):
    """torch maps only the zipfile format (torch.save's default, what save_checkpoint writes)."""
    path = tmp_path / "step_00000002.pt"
    torch.save(train_checkpoint({}, {}).to_file(), path, _use_new_zipfile_serialization=False)
    with pytest.raises(PipelineError, match="cannot read checkpoint .*step_00000002.pt.*zipfile.*--force"):
        checkpoint.read_checkpoint(path)
