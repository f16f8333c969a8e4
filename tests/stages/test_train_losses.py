"""Stage 04's --loss end to end on the tiny Llama: the choice travels into the manifest, and the
held-out split reports the acceptance under sampling next to the greedy figures (log,
metrics.jsonl, manifest), with the target's mass outside the draft vocabulary as computed
from the target itself."""
import json

import pytest
import torch
from fixtures import copy_stages
from transformers import AutoModelForCausalLM

from eagle3.artifacts.manifest import record_of
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.vocab_map import load_mapping, target_ids
from eagle3.artifacts.workdir import WorkDir
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter
from eagle3.stages.s04_train.target_mass import draft_vocab_mass
from eagle3.target.head import load_lm_head
from eagle3.target.info import read_target_info

SMALL = dict(batch_tokens=1024, max_seq_len=256, log_every=1, eval_every=2, save_every=1000, ttt_steps=3,
             warmup_steps=1, max_steps=2, learning_rate=3e-3)


def test_held_out_acceptance_under_sampling_is_reported_beside_greedy(tmp_path, stages_123, tiny_llama, caplog):
    workdir = copy_stages(stages_123, tmp_path / "w")
    with caplog.at_level("INFO"):
        m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(tiny_llama), loss="lk_lambda", lk_eta=2.0,
                                      **SMALL))
    assert m.params["loss"] == "lk_lambda" and m.params["lk_eta"] == 2.0
    K = SMALL["ttt_steps"]
    lines = [json.loads(x) for x in WorkDir(workdir).train_metrics().read_text().splitlines()]
    evals = [x for x in lines if x["split"] == "eval"]
    assert [x["step"] for x in evals] == [0, 2]
    for x in evals:
        accept = [x[f"accept_prob_{k}"] for k in range(K)]
        chained = [x[f"sample_full_acc_{k}"] for k in range(K)]
        assert all(0 < a < 1 for a in accept) and x["num_valid_0"] == x["num_valid"] > 0
        assert chained[0] == pytest.approx(accept[0]) and chained[0] > chained[1] > chained[2] > 0
        assert x["sample_accept_length"] == pytest.approx(1 + sum(chained))
        assert "ce_0" in x and "expected_accept_length" in x  # the greedy figure stays beside it
    for x in lines:
        if x["split"] == "train":
            assert "ce_0" in x and "sample_accept_length" not in x  # training computes no mass
    record = record_of(m)
    final = m.counts["final_eval"]
    best = evals[record.best_step // 2]
    assert record.best_eval["sample_accept_length"] == pytest.approx(best["sample_accept_length"])
    assert final["sample_accept_length"] == pytest.approx(evals[-1]["sample_accept_length"])
    assert f"len {evals[-1]['sample_accept_length']:.3f}" in caplog.text  # the eval log line
    assert "under sampling" in caplog.text  # the end-of-run block


def test_the_mass_outside_the_draft_vocabulary_is_the_targets_own(stages_123, tiny_llama):
    """The draft rows' share of the target's distribution, from the store's normed final
    state and the checkpoint's lm_head, is what the target model itself gives."""
    workdir = WorkDir(stages_123)
    store = HiddenStateStore.open(workdir, needed_by="the test")
    sample = store.split("eval")[0]
    info = read_target_info(tiny_llama)
    d2t, _ = load_mapping(workdir)
    draft = target_ids(d2t)
    got = draft_vocab_mass(sample.final, load_lm_head(info).float(), draft)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(sample.input_ids.long()[None]).logits[0]  # [T, V_t]
    want = torch.softmax(logits, dim=-1)[:, draft].sum(-1)
    assert 0.05 < float(want.mean()) < 0.95  # the draft vocabulary holds part of the mass, not all
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # the store's state is bf16
