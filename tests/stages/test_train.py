"""Stage 04 end to end on a tiny target: resume, DDP, and fine-tuning without scrambled labels."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import ROOT, claim_held_elsewhere, copy_stages
from safetensors.torch import load_file, save_file

from eagle3.artifacts.manifest import read_manifest, record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.stages.s03_vocab.run import build_vocab_mapping
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.finetune import remap_lm_head
from eagle3.stages.s04_train.run import train_drafter

SMALL = dict(batch_tokens=1024, max_seq_len=256, log_every=1, eval_every=1000, save_every=1000, ttt_steps=3,
             warmup_steps=2)


@pytest.fixture(scope="session")
def sharp_llama(tmp_path_factory, tiny_llama) -> Path:
    """The tiny Llama with its lm_head scaled up: a random but confident teacher, so a
    good drafter's loss sits well below uniform and a scrambled one's well above."""
    out = tmp_path_factory.mktemp("sharp") / "target"
    shutil.copytree(tiny_llama, out)
    w = load_file(out / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] * 40
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def stages_123(stage_runs, sharp_llama) -> Path:
    """Stages 01-03 on 120 demo chats (draft vocab 128); copy before training in it."""
    return stage_runs(sharp_llama, chats=120)


def fresh(base: Path, dest: Path, vocab: int | None = None) -> Path:
    copy_stages(base, dest)
    if vocab is not None:
        build_vocab_mapping(VocabConfig(work_dir=dest, draft_vocab_size=vocab, force=True))
    return dest


def weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_killed_and_resumed_run_equals_unbroken_run(tmp_path, stages_123, sharp_llama):
    a, b = fresh(stages_123, tmp_path / "a"), fresh(stages_123, tmp_path / "b")
    cfg = dict(target_model=str(sharp_llama), max_steps=6, learning_rate=2e-3, **{**SMALL, "save_every": 2})
    train_drafter(TrainConfig(work_dir=b, **cfg))
    assert train_drafter(TrainConfig(work_dir=a, stop_after=3, **cfg)) is None  # "killed" after step 3
    assert not WorkDir(a).manifest("train").exists()
    assert json.loads(WorkDir(a).latest_checkpoint().read_text())["step"] == 2  # step 3's work is lost
    m = train_drafter(TrainConfig(work_dir=a, **cfg))  # resumes from step 2
    assert record_of(m).steps == 6
    wa, wb = weights(WorkDir(a).checkpoint(6)), weights(WorkDir(b).checkpoint(6))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    lines = [json.loads(line) for line in WorkDir(a).train_metrics().read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [1, 2, 3, 4, 5, 6]  # no duplicate step 3
    # a finished run is not redone
    before = WorkDir(a).manifest("train").read_text()
    train_drafter(TrainConfig(work_dir=a, **cfg))
    assert WorkDir(a).manifest("train").read_text() == before


def test_a_second_trainer_on_one_work_dir_is_refused_before_it_deletes_or_writes(tmp_path, stages_123, sharp_llama):
    """One trainer per work dir: while a live process holds 04_train (as a running stage 04
    does), another run, --force or not, is refused before it deletes or writes a byte there;
    once that process is gone, the next run takes the folder over and resumes."""
    a = fresh(stages_123, tmp_path / "a")
    cfg = dict(target_model=str(sharp_llama), max_steps=4, learning_rate=2e-3, **{**SMALL, "save_every": 2})
    assert train_drafter(TrainConfig(work_dir=a, stop_after=2, **cfg)) is None  # a checkpoint at step 2
    train_dir = WorkDir(a).stage_dir("train")

    def files() -> dict:
        return {p.relative_to(train_dir): p.read_bytes() for p in sorted(train_dir.rglob("*"))
                if p.is_file() and not p.name.startswith(".claim")}

    before = files()
    with claim_held_elsewhere(train_dir, "stage 04"):
        for force in (False, True):
            with pytest.raises(PipelineError, match="one writer per folder"):
                train_drafter(TrainConfig(work_dir=a, force=force, **cfg))
        assert files() == before
    m = train_drafter(TrainConfig(work_dir=a, **cfg))  # its holder killed: taken over, resumed from step 2
    assert record_of(m).steps == 4 and not (train_dir / ".claim.json").exists()
    lines = [json.loads(line) for line in WorkDir(a).train_metrics().read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [1, 2, 3, 4]


def test_two_process_gloo_run_equals_one_process_with_grad_accum(tmp_path, stages_123, sharp_llama):
    one, two = fresh(stages_123, tmp_path / "one"), fresh(stages_123, tmp_path / "two")
    cfg = dict(target_model=str(sharp_llama), max_steps=3, learning_rate=2e-3, **SMALL)
    train_drafter(TrainConfig(work_dir=one, grad_accum=2, **cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        "29517", str(ROOT / "04_train_drafter.py"), "--work-dir", str(two), "--device", "cpu",
                        *flags], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_manifest(WorkDir(two), "train", needed_by="test")
    assert m.counts["processes"] == 2 and record_of(m).steps == 3
    # Each rank leaves without the interpreter's teardown (eagle3/core/cli.py): its log is flushed first.
    assert "stage 04 finished: 3 steps" in WorkDir(two).log_file("04_train").read_text()
    w1, w2 = weights(WorkDir(one).checkpoint(3)), weights(WorkDir(two).checkpoint(3))
    for k in w1:
        assert torch.allclose(w1[k].float(), w2[k].float(), atol=1e-5, rtol=1e-4), k


@pytest.fixture(scope="session")
def trained_export(tmp_path_factory, stages_123, sharp_llama):
    """A drafter trained on mapping A (128 tokens) and exported as SGLang/vLLM expect."""
    from eagle3.stages.s05_export.config import ExportConfig
    from eagle3.stages.s05_export.run import export_drafter

    workdir = fresh(stages_123, tmp_path_factory.mktemp("ft") / "w1")
    m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(sharp_llama), max_steps=40, learning_rate=3e-3,
                                  **{**SMALL, "log_every": 10, "eval_every": 40}))
    out = export_drafter(ExportConfig(work_dir=workdir, target_model=str(sharp_llama)))
    return workdir, Path(out), m


def test_fine_tune_keep_reproduces_the_drafters_own_loss(tmp_path, stages_123, sharp_llama, trained_export, caplog):
    src_wd, export_dir, src_m = trained_export
    uniform = math.log(128)
    assert src_m.counts["final_eval"]["loss_0"] < uniform - 0.5  # the teacher is confident; the drafter learned
    # another work dir whose stage 03 chose a different mapping (96 tokens: most positions differ)
    workdir = fresh(stages_123, tmp_path / "w2", vocab=96)
    with caplog.at_level("INFO"):
        m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(sharp_llama), init_from=str(export_dir),
                                      max_steps=1, learning_rate=1e-5, **SMALL))
    assert "positions differ" in caplog.text and "vocab mode 'keep'" in caplog.text
    rep = m.extra["init_from"]
    assert rep["vocab_mode"] == "keep" and rep["positions_differing"] > 0 and rep["tokens_shared"] == 96
    start = [json.loads(x) for x in WorkDir(workdir).train_metrics().read_text().splitlines()][0]
    assert start["split"] == "eval" and start["step"] == 0
    # same weights (bf16-rounded by export), same mapping, same held-out positions: same loss
    assert start["loss_0"] == pytest.approx(src_m.counts["final_eval"]["loss_0"], rel=0.02)
    assert start["full_acc_0"] == pytest.approx(src_m.counts["final_eval"]["full_acc_0"], abs=0.03)


def test_remap_keeps_every_shared_tokens_logit():
    g = torch.Generator().manual_seed(0)
    H, V = 16, 50
    a_ids = np.array([1, 3, 4, 8, 10, 20, 33, 40])
    b_ids = np.array([0, 3, 8, 9, 20, 33, 41])
    head_a = torch.randn(len(a_ids), H, generator=g)
    target = torch.randn(V, H, generator=g)
    head_b, copied, new = remap_lm_head(head_a, a_ids, b_ids, lambda ids: target[torch.from_numpy(ids)])
    assert (copied, new) == (4, 3)
    x = torch.randn(5, H, generator=g)
    la, lb = x @ head_a.T, x @ head_b.T
    for j, t in enumerate(b_ids):
        if t in a_ids:
            # the row itself is copied, bit for bit ...
            assert torch.equal(head_b[j], head_a[list(a_ids).index(t)])
            # ... so its logit agrees; two matmuls of different shapes are not
            # bitwise equal on every CPU, hence a tolerance here
            torch.testing.assert_close(lb[:, j], la[:, list(a_ids).index(t)], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(head_b[j], target[t])
    # on the shared tokens, the distribution (renormalised over them) is unchanged
    shared = [t for t in b_ids if t in a_ids]
    pa = torch.log_softmax(la[:, [list(a_ids).index(t) for t in shared]], -1)
    pb = torch.log_softmax(lb[:, [list(b_ids).index(t) for t in shared]], -1)
    assert torch.allclose(pa, pb)


def test_fine_tune_remap_reports_rows(tmp_path, stages_123, sharp_llama, trained_export):
    _, export_dir, _ = trained_export
    workdir = fresh(stages_123, tmp_path / "w3", vocab=96)
    m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(sharp_llama), init_from=str(export_dir),
                                  vocab_mode="remap", max_steps=1, learning_rate=1e-5, **SMALL))
    rep = m.extra["init_from"]
    assert rep["vocab_mode"] == "remap" and rep["rows_copied"] == 96 and rep["rows_new"] == 0
    d2t = torch.load(WorkDir(workdir).d2t(), weights_only=True)
    assert torch.equal(weights(WorkDir(workdir).best_checkpoint())["d2t"], d2t)  # trained under stage 03's mapping


def test_a_fine_tune_that_only_hurts_exports_its_starting_weights(tmp_path, stages_123, sharp_llama, trained_export,
                                                                   caplog):
    """With --init-from, step 0 is a candidate for best.pt: a learning rate that only
    hurts a converged drafter leaves best.pt (and stage 05's export) its input."""
    from eagle3.stages.s05_export.config import ExportConfig
    from eagle3.stages.s05_export.run import export_drafter

    _, export_dir, _ = trained_export
    workdir = fresh(stages_123, tmp_path / "w7")
    with caplog.at_level("INFO"):
        m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(sharp_llama), init_from=str(export_dir),
                                      max_steps=2, learning_rate=0.5, **{**SMALL, "warmup_steps": 0}))
    evals = {x["step"]: x for x in map(json.loads, WorkDir(workdir).train_metrics().read_text().splitlines())
             if x["split"] == "eval"}
    start, final = evals[0], evals[2]
    assert start["expected_accept_length"] > 2.0  # a drafter trained to convergence (K = 3: at most 4)
    # the learning rate only hurt: the loss is far worse, and so is the figure best.pt is chosen by
    assert final["loss_0"] > start["loss_0"] + 5, (start, final)
    assert final["expected_accept_length"] < start["expected_accept_length"], (start, final)
    assert record_of(m).best_step == 0 and m.counts["best_is_initial"] is True
    assert record_of(m).best_expected_accept_length == start["expected_accept_length"]
    assert (f"no trained step beat the initial drafter (held-out expected accept length "
            f"{start['expected_accept_length']:.3f} at step 0); best.pt holds the initial weights") in caplog.text
    src = load_file(export_dir / "model.safetensors")
    best = torch.load(WorkDir(workdir).best_checkpoint(), map_location="cpu", weights_only=True)
    assert best["step"] == 0 and best["eval"]["expected_accept_length"] == start["expected_accept_length"]
    for k, v in src.items():  # the loaded weights themselves (bf16 -> fp32 -> bf16 is exact)
        assert torch.equal(best["model"][k].to(v.dtype), v), k
    # stage 05 exports the initial weights
    out = Path(export_drafter(ExportConfig(work_dir=workdir, target_model=str(sharp_llama))))
    got = load_file(out / "model.safetensors")
    assert got.keys() == src.keys()
    for k in src:
        assert torch.equal(got[k], src[k]), k
    report = json.loads((out / "export_report.json").read_text())
    assert report["checkpoint"]["step"] == 0
    assert report["expected_accept_length"]["value"] == pytest.approx(start["expected_accept_length"])


@pytest.mark.parametrize("loss", ["kl", "tv"])  # the gate reads the cross-entropy whatever --loss trains
def test_weights_with_another_drafters_mapping_are_stopped_by_the_starting_loss_gate(
        tmp_path, stages_123, sharp_llama, trained_export, loss):
    _, export_dir, _ = trained_export
    # The failure this product exists for: the drafter's weights with a d2t from elsewhere.
    bad = tmp_path / "scrambled"
    shutil.copytree(export_dir, bad)
    t = load_file(bad / "model.safetensors")
    V = t["t2d"].shape[0]
    # Like two drafters' mappings built from different data: mostly the same tokens,
    # ten swapped (out at the bottom, in at the top) shift almost every position.
    ids = (t["d2t"] + torch.arange(128)).numpy()
    swap_in = np.setdiff1d(np.arange(V), ids)[-10:]
    other = np.sort(np.concatenate([ids[10:], swap_in]))
    assert (other != ids).sum() > 100
    t["d2t"] = torch.from_numpy(other - np.arange(128))
    t["t2d"] = torch.zeros(V, dtype=torch.bool)
    t["t2d"][torch.from_numpy(other)] = True
    save_file(t, bad / "model.safetensors")
    workdir = fresh(stages_123, tmp_path / "w4")
    with pytest.raises(PipelineError, match=r"worse than uniform .* mapping .* aux layer ids"):
        train_drafter(TrainConfig(work_dir=workdir, target_model=str(sharp_llama), init_from=str(bad), max_steps=1,
                                  loss=loss, **SMALL))
    assert not WorkDir(workdir).checkpoints().exists()


def test_a_mapping_that_never_holds_the_target_argmax_is_refused(tmp_path, stages_123, sharp_llama):
    workdir = WorkDir(fresh(stages_123, tmp_path / "w6"))
    freq = np.load(workdir.token_freq("train"))
    # frequencies that make stage 03 pick 16 ids no assistant token ever is (same
    # file size, so stage 01's manifest still accepts the file)
    fake = np.zeros_like(freq)
    fake[np.flatnonzero(freq == 0)[:16]] = 1
    np.save(workdir.token_freq("train"), fake)
    build_vocab_mapping(VocabConfig(work_dir=workdir.root, draft_vocab_size=16, force=True))
    with pytest.raises(PipelineError, match="no held-out position can be trained"):
        train_drafter(TrainConfig(work_dir=workdir.root, target_model=str(sharp_llama), max_steps=1, **SMALL))


def test_init_from_refuses_other_aux_layers(tmp_path, stages_123, sharp_llama, trained_export):
    _, export_dir, _ = trained_export
    bad = tmp_path / "layers"
    shutil.copytree(export_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 4, 6]
    (bad / "config.json").write_text(json.dumps(cfg))
    workdir = fresh(stages_123, tmp_path / "w5")
    with pytest.raises(PipelineError, match=r"aux layer mismatch: .* layers \[1, 4, 6\] .* store has \[2, 4, 5\]"):
        train_drafter(TrainConfig(work_dir=workdir, target_model=str(sharp_llama), init_from=str(bad), max_steps=1,
                                  **SMALL))


def test_keep_evaluated_keeps_the_newest_evaluated_checkpoints_with_their_held_out_figures(tmp_path, stages_123,
                                                                                          sharp_llama):
    """--keep-evaluated 3: every evaluation is saved with its metrics, the newest three stay
    beside best.pt and the resume point; --keep-checkpoints 1 alone would keep only step 8."""
    from eagle3.artifacts.train_outputs import evaluated_checkpoints, read_checkpoint

    work = fresh(stages_123, tmp_path / "w")
    train_drafter(TrainConfig(work_dir=work, target_model=str(sharp_llama), max_steps=8, learning_rate=2e-3,
                              keep_checkpoints=1, keep_evaluated=3, **{**SMALL, "eval_every": 2}))
    workdir = WorkDir(work)
    assert sorted(p.name for p in workdir.checkpoints().glob("step-*.pt")) == [workdir.checkpoint(s).name for s in (4, 6, 8)]
    kept = evaluated_checkpoints(workdir)
    assert [c.step for _, c in kept] == [4, 6, 8]
    evals = {x["step"]: x for x in map(json.loads, workdir.train_metrics().read_text().splitlines()) if x["split"] == "eval"}
    for _, c in kept:  # each file carries the figures logged at its own step
        assert c.eval["expected_accept_length"] == evals[c.step]["expected_accept_length"]
    assert read_checkpoint(workdir.best_checkpoint()).step in evals
