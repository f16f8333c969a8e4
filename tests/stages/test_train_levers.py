"""Stage 04's data-efficiency options: --loss-on, --aux-noise, --init-layer, --train-fraction, and
--drafter-shape (EAGLE 3.1) from training through the checkpoint and manifest to stage 05's export."""
import json
from pathlib import Path

import pytest
import torch
from fixtures import copy_stages
from transformers import AutoModelForCausalLM

from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.train_outputs import read_checkpoint
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.data import nested_share, noisy_aux
from eagle3.stages.s04_train.loss_positions import count_loss_positions
from eagle3.stages.s04_train.run import drafter_config_for_target, train_drafter
from eagle3.stages.s04_train.target_layer_init import init_from_target_layer, init_head_from_target
from eagle3.stages.s05_export.config import ExportConfig
from eagle3.stages.s05_export.run import export_drafter
from eagle3.target.info import read_target_info

SMALL = dict(batch_tokens=1024, max_seq_len=256, log_every=1, eval_every=1000, save_every=1000, ttt_steps=2,
             warmup_steps=1, max_steps=2)


def test_nested_share_is_nested_and_keeps_the_split_order():
    samples = list(range(100, 200, 3))  # 34 sample indices
    shares = {f: nested_share(samples, f, seed=5) for f in (0.125, 0.25, 0.5, 1.0)}
    assert [len(shares[f]) for f in (0.125, 0.25, 0.5, 1.0)] == [5, 9, 17, 34]  # ceil(f * 34)
    assert set(shares[0.125]) <= set(shares[0.25]) <= set(shares[0.5]) <= set(shares[1.0]) == set(samples)
    for share in shares.values():
        assert share == sorted(share)
    assert nested_share(samples, 0.5, seed=6) != shares[0.5]  # the seed picks the share
    assert nested_share(samples, 0.001, seed=5) and len(nested_share(samples, 0.001, seed=5)) == 1


def test_aux_noise_is_scaled_per_layer_and_keeps_the_dtype():
    torch.manual_seed(0)
    B, T, A, H = 2, 64, 3, 256
    scales = torch.tensor([0.01, 1.0, 50.0])  # aux layers differ by orders of magnitude
    aux = (torch.randn(B, T, A, H) * scales[:, None]).view(B, T, A * H).to(torch.bfloat16)
    out = noisy_aux(aux, 0.1, A)
    assert out.dtype == torch.bfloat16 and out.shape == aux.shape
    rms = aux.float().view(B, T, A, H).pow(2).mean(-1, keepdim=True).sqrt()
    rel = ((out.float() - aux.float()).view(B, T, A, H) / rms).std(dim=(0, 1, 3))  # [A]
    assert torch.allclose(rel, torch.full((A,), 0.1), rtol=0.05), rel
    assert torch.equal(noisy_aux(aux, 0.0, A), aux)


def test_init_layer_makes_the_drafter_layer_the_target_layer(tiny_llama):
    """With the embedding half at zero, one draft step on hidden state h is the target's
    own decoder layer applied to h (same RoPE positions)."""
    info = read_target_info(tiny_llama)
    cfg = TrainConfig(work_dir=Path("unused"), target_model=str(tiny_llama))
    drafter_config = drafter_config_for_target(info, cfg, 64)
    drafter = Eagle3Drafter(drafter_config, attention="reference").eval()
    assert init_from_target_layer(drafter, info, -1) == info.num_layers - 1
    target = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    torch.manual_seed(0)
    T = 12
    h = torch.randn(1, T, info.hidden_size)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        got = drafter.step(torch.randn(1, T, info.hidden_size), h, TTTCache(), position_ids=pos)
        rotary = target.model.rotary_emb(h, pos)
        want = target.model.layers[info.num_layers - 1](h, position_embeddings=rotary, position_ids=pos,
                                                        attention_mask=None)
        want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_init_head_and_layer_make_the_first_draft_the_targets_tail(tiny_llama):
    """--init-layer -1 --init-head: step 0's logits on the deepest aux state h are the
    target's last layer, final norm and lm_head rows applied to h."""
    info = read_target_info(tiny_llama)
    cfg = TrainConfig(work_dir=Path("unused"), target_model=str(tiny_llama))
    drafter_config = drafter_config_for_target(info, cfg, 64)
    drafter = Eagle3Drafter(drafter_config, attention="reference").eval()
    draft_ids = torch.arange(64) * 3  # any rows of the target vocab
    drafter.set_vocab_mapping(draft_ids - torch.arange(64), torch.isin(torch.arange(info.vocab_size), draft_ids))
    init_from_target_layer(drafter, info, -1)
    aux_layers = [info.num_layers - 1, 0, 1]  # the deepest need not come last in the store's order
    init_head_from_target(drafter, info, aux_layers)
    target = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    torch.manual_seed(0)
    T, H = 10, info.hidden_size
    h = torch.randn(1, T, H)
    aux = torch.cat([h, torch.randn(1, T, H), torch.randn(1, T, H)], dim=-1)  # [1, T, 3H]
    pos = torch.arange(T)[None]
    with torch.no_grad():
        logits, _ = drafter(aux, torch.randn(1, T, H), position_ids=pos)
        out = target.model.layers[-1](h, position_embeddings=target.model.rotary_emb(h, pos), position_ids=pos,
                                      attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        want = target.lm_head(target.model.norm(out))[..., draft_ids]  # [1, T, V] -> [1, T, 64]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_init_layer_refuses_a_layer_the_target_lacks_and_other_shapes(tiny_llama):
    info = read_target_info(tiny_llama)
    cfg = TrainConfig(work_dir=Path("unused"), target_model=str(tiny_llama))
    drafter = Eagle3Drafter(drafter_config_for_target(info, cfg, 64))
    with pytest.raises(PipelineError, match=rf"--init-layer {info.num_layers} is not a layer of the target"):
        init_from_target_layer(drafter, info, info.num_layers)
    narrow = TrainConfig(work_dir=Path("unused"), target_model=str(tiny_llama), intermediate_size=24)
    drafter = Eagle3Drafter(drafter_config_for_target(info, narrow, 64))
    with pytest.raises(PipelineError, match="does not have the drafter's shapes.*mlp.gate_proj.weight"):
        init_from_target_layer(drafter, info, 0)
    with pytest.raises(PipelineError, match="pass one of them"):
        TrainConfig(work_dir=Path("unused"), target_model=str(tiny_llama), init_layer=0, init_from="x")


def test_loss_on_all_counts_prompt_positions(stages_123, tiny_llama):
    split = HiddenStateStore.open(WorkDir(stages_123), needed_by="the test").split("train")
    t2d = torch.ones(read_target_info(tiny_llama).vocab_size, dtype=torch.bool)
    assistant = count_loss_positions(split, t2d, 256)
    everything = count_loss_positions(split, t2d, 256, assistant_only=False)
    assert everything.outside_mask == 0 and assistant.outside_mask > 0
    assert everything.carrying == assistant.carrying + assistant.outside_mask
    assert everything.assistant == assistant.assistant  # the assistant count is the mask's, either way


def test_a_run_with_every_lever_trains_and_records_them(tmp_path, stages_123, tiny_llama, caplog):
    workdir = copy_stages(stages_123, tmp_path / "w")
    with caplog.at_level("INFO"):
        m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(tiny_llama), loss_on="all", aux_noise=0.05,
                                      init_layer=-1, init_head=True, train_fraction=0.5, **SMALL))
    assert m.params["loss_on"] == "all" and m.params["init_layer"] == -1 and m.params["train_fraction"] == 0.5
    assert "--train-fraction 0.5: training on" in caplog.text
    assert "starts from target layer" in caplog.text and "norm and lm_head are the target's" in caplog.text
    lines = [json.loads(x) for x in WorkDir(workdir).train_metrics().read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    assert len(train) == 2 and all(torch.isfinite(torch.tensor(x["loss_0"])) for x in train), train


def test_an_eagle31_drafter_trains_and_its_shape_reaches_the_checkpoint_manifest_and_export(tmp_path, stages_123,
                                                                                           tiny_llama):
    workdir = copy_stages(stages_123, tmp_path / "w")
    m = train_drafter(TrainConfig(work_dir=workdir, target_model=str(tiny_llama), drafter_shape="eagle3.1", **SMALL))
    assert m.params["drafter_shape"] == "eagle3.1"
    assert m.extra["drafter_config"]["fc_norm"] is True and m.extra["drafter_config"]["norm_output"] is True
    ckpt = read_checkpoint(WorkDir(workdir).best_checkpoint())
    assert ckpt.drafter_config["fc_norm"] and sorted(k for k in ckpt.model if k.startswith("fc_norm.")) == [
        "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    lines = [json.loads(x) for x in WorkDir(workdir).train_metrics().read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(x["loss_0"])) for x in lines if x["split"] == "train")

    out = export_drafter(ExportConfig(work_dir=workdir, target_model=str(tiny_llama)))
    hf = json.loads((out / "config.json").read_text())
    assert hf["fc_norm"] is True and hf["norm_output"] is True
    report = json.loads(WorkDir(workdir).export_report("json").read_text())
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(report["tensors"]) and report["findings"] == []
    assert "- drafter: eagle3.1, hidden" in WorkDir(workdir).export_report("md").read_text()
    assert "EAGLE 3.1" in (out / "README.md").read_text()

    # a fine-tune of it stays an eagle3.1 drafter; asking for the plain shape is refused before any work
    again = copy_stages(stages_123, tmp_path / "again")
    m2 = train_drafter(TrainConfig(work_dir=again, target_model=str(tiny_llama), init_from=str(out),
                                   allow_bad_start=True, **{**SMALL, "max_steps": 1}))  # 2 steps: near uniform
    assert m2.extra["drafter_config"]["fc_norm"] is True and m2.extra["init_from"]["drafter_shape"] == "eagle3.1"
    with pytest.raises(PipelineError, match="--drafter-shape eagle3, but"):
        train_drafter(TrainConfig(work_dir=copy_stages(stages_123, tmp_path / "plain"), target_model=str(tiny_llama),
                                  init_from=str(out), drafter_shape="eagle3", **SMALL))
