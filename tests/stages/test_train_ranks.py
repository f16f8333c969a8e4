"""Stage 04 under torchrun: the held-out figures and the best checkpoint do not depend on the
number of processes (eagle3/stages/s04_train/evaluation.py), and ranks with unequal held-out
batch counts finish (no collective inside a forward: distributed.wrap_ddp).

Each case trains 2 steps and evaluates at steps 0, 1 and 2, once in this process with
--grad-accum 2 and once as two gloo processes (which train on the same micro-batches per
step), on a held-out split of 7 samples that packs into 3 rows (ranks evaluate 2 and 1)
or into 1 row (ranks evaluate 1 and 0). Before the fix each rank took `3 // 2` rows and
dropped the rest (33 of 38 held-out positions), and with 1 row every rank took none and
stage 04 stopped with "no held-out position can be trained".
"""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import ROOT, copy_stages

from eagle3.artifacts.manifest import read_manifest, record_of
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.data import Batching, epoch_batches
from eagle3.stages.s04_train.evaluation import held_out_batches
from eagle3.stages.s04_train.run import train_drafter

RUN = dict(max_steps=2, max_seq_len=256, ttt_steps=2, warmup_steps=1, learning_rate=2e-3, log_every=1, eval_every=1,
           save_every=1000, device="cpu")
TIMEOUT_S = 240  # a hang (one rank waiting in a collective the other never enters) fails here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def torchrun_2(args: list, timeout: float, logs: Path) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 ARGS`, its output in files under `logs`. On a timeout the
    workers are killed too: torchrun starts each in a session of its own, so killing torchrun
    alone would leave them waiting in their collective forever."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           *map(str, args)]
    logs.mkdir()
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            workers = children(p.pid)
            p.kill()
            p.wait()
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            pytest.fail(f"two processes did not finish in {timeout} s (a rank left waiting in a collective the "
                        f"other never enters): {(logs / 'stderr').read_text()[-2000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, (logs / "stdout").read_text(), (logs / "stderr").read_text())


def eval_rows(workdir: WorkDir) -> dict[int, dict]:
    rows = [json.loads(line) for line in workdir.train_metrics().read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == "eval"}


def test_every_held_out_batch_goes_to_exactly_one_rank():
    lengths = [100] * 7  # 7 rows of one sample each
    b = Batching(batch_tokens=128, max_seq_len=128, seed=0)
    for world in (1, 2, 3, 8):
        shares = [held_out_batches(lengths, b, None, r, world) for r in range(world)]
        assert sorted(i for s in shares for batch in s for i in batch) == list(range(7)), world
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert [len(held_out_batches(lengths, b, None, r, 8)) for r in range(8)] == [1] * 7 + [0]
    # --eval-batches caps the batches of the whole run, not of each rank
    assert [held_out_batches(lengths, b, 3, r, 2) for r in range(2)] == [[[0], [2]], [[1]]]


@pytest.mark.parametrize("batch_tokens, rows", [(256, 3), (1024, 1)])
def test_two_processes_evaluate_what_one_does(tmp_path, stages_123, tiny_llama, batch_tokens, rows):
    store = HiddenStateStore.open(WorkDir(stages_123), needed_by="test")
    assert len(epoch_batches(store.split("eval").lengths(), Batching(batch_tokens, 256, 0), None)) == rows
    one, two = copy_stages(stages_123, tmp_path / "one"), copy_stages(stages_123, tmp_path / "two")
    cfg = dict(target_model=str(tiny_llama), batch_tokens=batch_tokens, **RUN)
    train_drafter(TrainConfig(work_dir=one, grad_accum=2, **cfg))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    r = torchrun_2([ROOT / "04_train_drafter.py", "--work-dir", two, *flags], TIMEOUT_S, tmp_path / "logs")
    assert r.returncode == 0, r.stderr[-3000:]
    m1, m2 = (read_manifest(WorkDir(w), "train", needed_by="test") for w in (one, two))
    assert (m1.counts["processes"], m2.counts["processes"]) == (1, 2)
    e1, e2 = eval_rows(WorkDir(one)), eval_rows(WorkDir(two))
    assert list(e1) == list(e2) == [0, 1, 2]
    assert e1[0]["num_valid"] > 30  # every held-out position (38), not a rank's share
    for step in e1:
        a, b = e1[step], e2[step]
        assert a["num_valid"] == b["num_valid"], step  # counts: exactly
        for k in (k for k in a if k.startswith(("loss_", "full_acc_"))):
            # sums over the same positions with weights equal up to float order (atol 1e-5 after 2 steps)
            assert b[k] * b["num_valid"] == pytest.approx(a[k] * a["num_valid"], rel=1e-4, abs=1e-6), (step, k)
    r1, r2 = record_of(m1), record_of(m2)
    assert r1.best_step == r2.best_step
    assert r2.best_expected_accept_length == pytest.approx(r1.best_expected_accept_length, rel=1e-6)
