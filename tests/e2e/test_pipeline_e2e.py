"""The demo pipeline end to end at a reduced size: a briefly trained tiny Llama target,
stages 01-05 with the shipped config, then stage 06 serving it in vLLM's CPU build with
the trained drafter and an untrained one. The trained drafter must accept more.

Stage 06 runs as a user benchmarks: a categorized prompt file (written here from the
demo's topics, prompts the drafter never saw), acceptance at temperatures 0 and 0.7
over all prompts at once, and a single-stream timing subset.

About 3 minutes on 2 idle cores (target training ~45 s, three engine starts ~25 s each).
Not skipped when vLLM is missing: CI installs it (scripts/setup_cpu.sh), and a drafter
that was never served is the failure this test exists to catch.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import DEMO_CHATS, ROOT, run_stages

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import build_config
from eagle3.stages.configs import STAGE_CONFIGS

CONFIG = ROOT / "configs" / "tiny-llama.yaml"
# Reduced from the demo (150 target steps, 120 drafter steps, 77 prompts x 64 tokens).
TARGET_STEPS = 60
DRAFTER_STEPS = 40
PER_CATEGORY, NEW_TOKENS, TIMED = 4, 32, 3
CATEGORIES = ("arithmetic", "capital", "counting")


def write_prompt_file(path: Path) -> Path:
    """Questions of three of the demo's topics, new draws (seeded), both record shapes."""
    import random

    from eagle3.demo import synthetic_chats

    rng = random.Random(7)
    rows = []
    for cat in CATEGORIES:
        for i in range(PER_CATEGORY):
            question, _ = getattr(synthetic_chats, cat)(rng)
            rows.append({"prompt": question, "topic": cat} if i % 2 else
                        {"messages": [{"role": "user", "content": question}], "topic": cat})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stage_config(cls, section: str, work: Path, target: Path, **overrides):
    """The shipped demo config with this test's work dir, target and reduced sizes."""
    return build_config(cls, section, CONFIG, {"work_dir": work, "target_model": str(target), **overrides},
                        sections=STAGE_CONFIGS)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from eagle3.stages.s06_evaluate.config import EvaluateConfig
    from eagle3.stages.s06_evaluate.run import evaluate_drafter
    from eagle3.demo.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("e2e")
    target = build_tiny_target("llama", root / "target", train_steps=TARGET_STEPS)
    work = run_stages(root / "work", target, upto="export", chats=DEMO_CHATS, config=CONFIG,
                      prepare=dict(num_workers=1), train=dict(max_steps=DRAFTER_STEPS, eval_every=20))
    ev_cfg = stage_config(EvaluateConfig, "evaluate", work, target, max_new_tokens=NEW_TOKENS, timed_passes=2,
                          prompts=str(write_prompt_file(root / "prompts.jsonl")), category_field="topic",
                          temperature=[0.0, 0.7], timing_prompts=TIMED)
    results = evaluate_drafter(ev_cfg)
    return WorkDir(work), ev_cfg, results


def test_trained_drafter_accepts_more_than_an_untrained_one_in_vllm(demo_run):
    workdir, cfg, r = demo_run
    K = cfg.num_speculative_tokens
    assert r["num_speculative_tokens"] == K == 3
    # The untrained drafter is the floor: it accepts (almost) nothing.
    assert r["untrained_acceptance_length"] < 1.1
    assert r["acceptance_length"] > r["untrained_acceptance_length"] + 0.2, r["acceptance_per_position"]
    per = r["acceptance_per_position"]
    assert len(per) == K and per[0] > 0 and all(a >= b for a, b in zip(per, per[1:]))  # chain: non-increasing
    # Greedy speculative decoding reproduces the target's own greedy output (up to bf16 batch rounding).
    assert r["outputs_match_plain"] >= 0.75
    assert r["expected_accept_length_training"]["value"] > 1.0 and r["expected_accept_length_training"]["k"] == K
    # Speed figures when the interleaved passes agree; on a machine busy with other work they
    # may not, and then no speed figure at all (tests/unit/test_speed_verdicts.py).
    speed = ("speedup", "break_even_acceptance_length")
    assert all(x > 0 for x in r["timing"]["pass_speedups"] + r["timing"]["pass_break_evens"])
    if r["timing_problems"]:
        assert all(r[key] is None for key in speed) and r["tokens_per_s"]["plain"] is None
    else:
        assert all(r[key] > 0 for key in speed)
        assert r["tokens_per_s"]["plain"] > 0 and r["tokens_per_s"]["speculative"] > 0


def test_acceptance_per_temperature_and_category_over_all_prompts(demo_run):
    workdir, cfg, r = demo_run
    n = PER_CATEGORY * len(CATEGORIES)
    assert r["prompts"]["count"] == n and r["teacher"]["greedy_equals_dataset_answer"] is None
    assert [row["temperature"] for row in r["acceptance"]] == [0.0, 0.7] == r["temperatures"]
    assert 1.0 <= r["acceptance"][0]["untrained"]["acceptance_length"] < 1.1
    assert r["acceptance"][1]["untrained"] is None  # the floor is served at the first temperature only
    for row in r["acceptance"]:
        t = row["trained"]
        assert t["acceptance_length"] > 1.0
        assert t["histograms_match_counters"] and t["ci95"] is not None and t["ci95"] > 0
        assert list(t["by_category"]) == list(CATEGORIES) == r["categories"]["names"]
        assert all(b["prompts"] == PER_CATEGORY for b in t["by_category"].values())
        # The categories split the same verification steps the engine counted overall.
        assert sum(b["drafts"] for b in t["by_category"].values()) == t["drafts"]
        overall = 1 + sum(b["accepted_tokens"] for b in t["by_category"].values()) / t["drafts"]
        assert overall == pytest.approx(t["acceptance_length"])
    assert r["acceptance_length"] == r["acceptance"][0]["trained"]["acceptance_length"]  # greedy is the headline
    # Sampled decoding sees other tokens than greedy: the two passes are different measurements.
    runs = workdir.stage_dir("evaluate") / "runs"
    trained = json.loads((runs / "plain+trained.result.json").read_text())["runs"]["trained"]
    assert trained["acceptance"][0]["tokens"] != trained["acceptance"][1]["tokens"]


def test_timing_is_single_stream_on_the_subset(demo_run):
    workdir, cfg, r = demo_run
    runs = workdir.stage_dir("evaluate") / "runs"
    req = json.loads((runs / "plain+trained.request.json").read_text())
    assert len(req["prompts"]) == PER_CATEGORY * len(CATEGORIES)
    assert [e["name"] for e in req["engines"]] == ["plain", "trained"]  # one worker, both engines alive
    # Round-robin over the categories: one prompt of each.
    timed = r["timing"]["indices"]
    assert timed == [0, PER_CATEGORY, 2 * PER_CATEGORY] and len(req["timing_blocks"]) == 2 * 2 * TIMED
    res = json.loads((runs / "plain+trained.result.json").read_text())["runs"]
    requests = []  # (start, wall, engine, prompt) of every timed request
    for name in ("plain", "trained"):
        assert len(res[name]["timing"]) == 2  # timed_passes = 2
        for p in res[name]["timing"]:
            assert len(p["tokens"]) == len(p["request_wall_s"]) == TIMED and p["prompts"] == timed
            requests += [(t, w, name, i) for t, w, i in zip(p["request_start_s"], p["request_wall_s"], p["prompts"])]
        # The same prompts, greedy, in both passes: the same outputs, identical work.
        assert res[name]["timing"][0]["tokens"] == res[name]["timing"][1]["tokens"]
    requests.sort()
    # One request at a time, each prompt on both engines back to back, the first one alternating.
    assert all(a[0] + a[1] <= b[0] for a, b in zip(requests, requests[1:]))
    pairs = [requests[k:k + 2] for k in range(0, len(requests), 2)]
    assert all(a[3] == b[3] and {a[2], b[2]} == {"plain", "trained"} for a, b in pairs)
    assert [a[2] for a, _ in pairs] == ["plain", "trained", "plain", "trained", "plain", "trained"]
    assert json.loads((runs / "untrained.result.json").read_text())["runs"]["untrained"]["timing"] == []
    assert r["timing"]["prompts"] == TIMED and r["timing"]["passes"] == 2


def test_results_plot_and_manifest_are_written(demo_run):
    workdir, _, r = demo_run
    assert json.loads(workdir.evaluate_results().read_text())["acceptance_length"] == r["acceptance_length"]
    assert workdir.evaluate_plot().read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = json.loads(workdir.manifest("evaluate").read_text())
    assert m["counts"]["acceptance_length"] == r["acceptance_length"]
    assert set(m["outputs"]) == {workdir.evaluate_results().name, workdir.evaluate_plot().name}


def test_rerun_does_nothing(demo_run):
    from eagle3.stages.s06_evaluate.run import evaluate_drafter

    workdir, cfg, r = demo_run
    f = workdir.evaluate_results()
    before = f.stat().st_mtime_ns
    assert evaluate_drafter(cfg)["acceptance_length"] == r["acceptance_length"]  # no engine started
    assert f.stat().st_mtime_ns == before


def test_demo_summary(demo_run):
    from eagle3.demo.summary import summary_text

    workdir, _, r = demo_run
    text = summary_text(workdir.root, elapsed_s=125)
    assert f"trained {r['acceptance_length']:.2f}  |  untrained {r['untrained_acceptance_length']:.2f}" in text
    assert "coverage of assistant tokens" in text and "full_acc_0" in text and "break-even" in text
    assert "trained beats untrained" in text and "wall time 2m05s" in text


def test_stage_06_fills_the_model_card_between_its_markers(demo_run):
    """Stage 05's card gets stage 06's measured table; a user's edit outside the markers survives
    a rerun, which writes the same table again (eagle3/serving/model_card.py)."""
    from huggingface_hub import ModelCard

    from eagle3.serving.model_card import CARD_NAME, EVALUATE_BEGIN, EVALUATE_END
    from eagle3.stages.s06_evaluate.run import evaluate_drafter

    workdir, cfg, r = demo_run
    card_path = Path(json.loads(workdir.manifest("export").read_text())["record"]["drafter_dir"]) / CARD_NAME
    text = card_path.read_text()
    table = text[text.index(EVALUATE_BEGIN):text.index(EVALUATE_END)]
    assert "Not measured yet" not in table and "| | greedy | T=0.7 |" in table
    assert f"vLLM {r['engine']['version']} on CPU: " in table and "| acceptance length | " in table
    for name in CATEGORIES:
        assert f"| topic: {name} (n={PER_CATEGORY}) | " in table
    speed = "timings unreliable: no verdict" if r["timing_problems"] else "Break-even acceptance length"
    assert f"{TIMED} prompts timed in 2 interleaved passes" in table and speed in table
    assert ModelCard(text).data.tags and "## Serve it" in text
    edited = text.replace("## Serve it", "My own note.\n\n## Serve it")
    card_path.write_text(edited)
    evaluate_drafter(cfg)  # complete: no engine, the same table written again
    assert card_path.read_text() == edited
