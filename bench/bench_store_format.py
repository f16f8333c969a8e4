"""The store's encodings side by side: bytes, write and read speed, what fp8 costs in quality.

    python bench/bench_store_format.py [--hidden 576] [--tokens 40000] [--files 8] [--target DIR] [--chats 200]
    python bench/bench_store_format.py --served --config configs/smollm2-135m.yaml [--work-dir W]

Default mode, in one process, for each encoding of `extract.store_dtype` (bf16, fp8):
  1. bytes per token at SmolLM2's widths (H = 576, 3 aux layers) and Kimi-K2.5's
     (H = 7168), computed from the layout (eagle3/artifacts/store/format.py), and the disk per million
     tokens; beside them what per-block fp8 scales (64 values a block) would cost;
  2. on a synthetic store (`--hidden`, `--tokens` in `--files` files; Gaussian states with
     a few large channels, as real residual streams have): finalize tokens/s (the step
     that writes each file: norm, argmax over a 4096-row head, encoding, checksum) and
     read tokens/s (shuffled samples through the reader and into training tensors, padded
     with `store.collate` and packed with stage 04's `load_batch`), page cache warm;
  3. on a real target's states (`--target`, default the demo's SmolLM2-135M-Instruct,
     built at work/targets/smollm2-135m by `python -m eagle3.demo.targets smollm2` if missing):
     stage 01 on `--chats` demo chats, stage 02 (hf backend) once per encoding, its tokens/s, and
     through the reader the fp8 store against the bf16 one: per aux layer and for the
     final state the per-token relative L2 error (median, p90, max; it holds the two runs'
     own differences too, shown by their stored argmax agreement), the same figures for
     the store's encoding and for alternative scale schemes applied to the bf16 store's
     states (the encoding's error alone; alternatives: a bf16 scale per token,
     amax / 256, which keeps each token's largest value exact; a float32 one, amax / 448;
     power-of-two per block of 64), and the teacher: top-1 agreement and mean
     KL(bf16 || fp8) of softmax(final @ lm_head.T) at the positions that can carry loss.

`--served` (a SmolLM2 demo work dir where stages 00-01 ran, and its config): per encoding,
copies stages 00-01 into a sibling work dir `W-store-{bf16,fp8}`, runs stages 02 (with
`--store-dtype`), 03, 04, 05 and 06 there as scripts/demo.sh does, and prints stage 06's
served acceptance length with its 95% interval and per position, next to stage 04's
held-out expected acceptance. A format may become the default only if its served
acceptance lies inside the bf16 run's interval. Takes as long as the demo's
stages 02-06 per encoding: run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.artifacts import store# noqa: E402

ENCODINGS = list(store.ENCODINGS)
WIDTHS = {"SmolLM2-135M (H=576)": 576, "Kimi-K2.5 (H=7168)": 7168}
BLOCK = 64  # per-block scale alternative: values per scale (divides 576 and 7168)
HEAD_ROWS = 4096  # synthetic finalize: rows of the lm_head the argmax runs over


# --------------------------------------------------------------------------- 1. bytes


def bytes_table() -> list[str]:
    out = ["== bytes per token (3 aux layers + final; computed from eagle3/artifacts/store/format.py's layout)",
           f"{'target':24s}{'encoding':10s}{'B/token':>10s}{'GB per 1M tokens':>18s}{'vs bf16':>9s}"]
    for label, H in WIDTHS.items():
        ref = store.bytes_per_token(H, 3)
        for name in ENCODINGS:
            b = store.bytes_per_token(H, 3, name)
            out.append(f"{label:24s}{name:10s}{b:>10,}{b * 1e6 / 1e9:>18.2f}{b / ref:>9.3f}")
        for alt, b in ((f"fp8/b{BLOCK}", 4 * H + 4 * (H // BLOCK) + 9), ("fp8/bf16s", 4 * H + 4 * 2 + 9),
                       ("fp8/f32s", 4 * H + 4 * 4 + 9)):  # other scale schemes (not built): see part 3
            out.append(f"{label:24s}{alt:10s}{b:>10,}{b * 1e6 / 1e9:>18.2f}{b / ref:>9.3f}   (not built, for comparison)")
    out.append(f"target: fp8 at most 4H + 16 B/token: {4 * 576 + 16:,} / {4 * 7168 + 16:,}")
    return out


# --------------------------------------------------------------------------- 2. speed


def synthetic_states(n: int, hidden: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 3, H] aux and [n, H] pre-norm states: Gaussian, a few channels 50x larger."""
    aux = torch.randn(n, 3, hidden, generator=g)
    aux[..., :4] *= 50
    pre = torch.randn(n, hidden, generator=g) * 3
    pre[:, :4] *= 50
    return aux, pre


def build_store(d: Path, name: str, hidden: int, tokens: int, files: int, seed: int = 0,
                head_rows: int = HEAD_ROWS) -> tuple[list[dict], float]:
    """A synthetic store of `name`; returns its entries and the seconds spent in finalize
    (`head_rows` 0: no argmax, the encoding and I/O alone)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    head = torch.randn(max(head_rows, 1), hidden, generator=torch.Generator().manual_seed(1))
    norm_w = torch.ones(hidden)

    def normalize(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w

    def argmax(h):
        if not head_rows:
            return torch.zeros(h.shape[0], dtype=torch.int64)
        return (h.float() @ head.T).argmax(-1)

    entries, first, spent = [], 0, 0.0
    for k in range(files):
        lengths = []
        while sum(lengths) < tokens // files:
            lengths.append(int(rng.integers(64, 512)))
        ids = [rng.integers(0, HEAD_ROWS, n).astype(np.int32) for n in lengths]
        masks = [np.ones(n, np.int8) for n in lengths]
        partial = d / store.partial_name("train", k)
        lay = store.create_partial_file(partial, split="train", file_no=k, first_sample=first, input_ids=ids,
                                        loss_masks=masks, hidden_size=hidden, aux_layers=[2, 4, 6], identity_hash="b")
        row = 0
        for n in lengths:
            aux, pre = synthetic_states(n, hidden, g)
            store.write_sample_states(partial, row, aux, pre, lay)
            row += n
        t0 = time.perf_counter()
        entries.append(store.finalize_file(partial, d / store.file_name("train", k), split="train", file_no=k,
                                           first_sample=first, sample_ids=[f"s{first + i}" for i in range(len(lengths))],
                                           identity_hash="b", normalize=normalize, argmax=argmax, store_dtype=name))
        spent += time.perf_counter() - t0
        first += len(lengths)
    return entries, spent


def open_store(d: Path, entries: list[dict], hidden: int, name: str) -> store.HiddenStateStore:
    n = sum(e["num_samples"] for e in entries)
    index = {"store_format": store.STORE_FORMAT,
             "identity": {"aux_layers": [2, 4, 6], "hidden_size": hidden, "num_layers": 8, "vocab_size": HEAD_ROWS,
                          "tokenizer_fingerprint": "t", "target_model": "m", **store.identity_fields(name)},
             "splits": {"train": {"num_samples": n, "samples_per_file": n, "num_files": len(entries),
                                  "files": entries}}}
    return store.HiddenStateStore(d, index, None, needed_by="bench")


def read_pass(s: store.HiddenStateStore, packed: bool, batch_tokens: int = 8192) -> float:
    """Seconds for one shuffled pass over the split into training tensors."""
    from eagle3.stages.s04_train.data import load_batch

    split = s.split("train")
    lengths = [e for f in split.files for e in np.diff(_offsets(s.dir / f["name"])).tolist()]
    order = list(range(len(split)))
    random.Random(0).shuffle(order)
    batches, cur, longest = [], [], 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    batches.append(cur)
    t0 = time.perf_counter()
    for b in batches:
        load_batch(split, b, max_seq_len=1 << 20, packed=packed)
    return time.perf_counter() - t0


def _offsets(path: Path) -> np.ndarray:
    lay, _ = store.FileLayout.read(path)
    with open(path, "rb") as f:
        f.seek(lay.offset("sample_offsets"))
        return np.frombuffer(f.read(8 * (lay.num_samples + 1)), dtype=np.int64)


def speed(hidden: int, tokens: int, files: int, repeats: int) -> list[str]:
    out = [f"== speed on a synthetic store: H={hidden}, 3 aux layers, {tokens:,} tokens in {files} files, "
           f"page cache warm, best of {repeats}",
           f"finalize: norm, argmax over a {HEAD_ROWS}-row head, encoding, checksum, rename; 'no argmax': without "
           "it (stage 02's full-vocab argmax costs the same in both encodings); read: shuffled, verify=lazy",
           f"{'encoding':10s}{'MB':>8s}{'finalize tok/s':>16s}{'no argmax':>11s}{'read+collate tok/s':>20s}"
           f"{'read+pack tok/s':>17s}"]
    for name in ENCODINGS:
        best_fin, best_bare, best_pad, best_pack, size = (float("inf"),) * 4 + (0,)
        for r in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                best_bare = min(best_bare, build_store(Path(tmp), name, hidden, tokens, files, head_rows=0)[1])
            with tempfile.TemporaryDirectory() as tmp:
                d = Path(tmp)
                entries, fin = build_store(d, name, hidden, tokens, files)
                size = sum(e["bytes"] for e in entries)
                n_tok = sum(e["num_tokens"] for e in entries)
                for e in entries:  # warm the page cache: the figures compare CPU costs, not the disk
                    (d / e["name"]).read_bytes()
                best_fin = min(best_fin, fin)
                best_pad = min(best_pad, read_pass(open_store(d, entries, hidden, name), packed=False))
                best_pack = min(best_pack, read_pass(open_store(d, entries, hidden, name), packed=True))
        out.append(f"{name:10s}{size / 1e6:>8.1f}{n_tok / best_fin:>16,.0f}{n_tok / best_bare:>11,.0f}"
                   f"{n_tok / best_pad:>20,.0f}{n_tok / best_pack:>17,.0f}")
    return out


# --------------------------------------------------------------------------- 3. quality on a target's states


def token_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error of a against b: [T, H] x [T, H] -> [T]."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def pow2_fp8(x: torch.Tensor) -> torch.Tensor:
    """The store's encoding (a power-of-two scale per row), dequantised to bf16 as the reader does."""
    return store.dequantize_fp8(*store.quantize_fp8(x))


def f32_scale_fp8(x: torch.Tensor) -> torch.Tensor:
    """Alternative: per-row float32 scale mapping the row max to 448 exactly (dequantised, float32)."""
    x = x.float()
    s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-30)  # [R, 1]
    return (x / s).to(store.FP8_DTYPE).float() * s


def bf16_scale_fp8(x: torch.Tensor) -> torch.Tensor:
    """Alternative: per-row bf16 scale amax / 256: the largest value (bf16, 8 significant bits)
    maps to 256 exactly, so the value that dominates a token's norm is stored exactly."""
    x = x.float()
    s = (x.abs().amax(-1, keepdim=True).to(torch.bfloat16).float() / 256).clamp_min(1e-30)  # [R, 1]
    return (x / s).to(store.FP8_DTYPE).float() * s


def block_fp8(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Alternative: the store's power-of-two scale per block of `block` values (dequantised, float32)."""
    R, H = x.shape
    q, e = store.quantize_fp8(x.reshape(R * H // block, block))  # [R, H] -> [R*H/block, block]
    return store.dequantize_fp8(q, e, torch.float32).view(R, H)


def _summary(err: torch.Tensor) -> str:
    return f"{err.median().item():.4f} / {err.quantile(0.9).item():.4f} / {err.max().item():.4f}"


def quality(target: Path | None, chats: int, work: Path) -> list[str]:
    from eagle3.stages.s02_extract.run import extract_hidden_states
    from eagle3.stages.s02_extract.config import ExtractConfig
    from eagle3.target.head import load_lm_head
    from eagle3.stages.s01_prepare.run import prepare_dataset
    from eagle3.stages.s01_prepare.config import PrepareConfig
    from eagle3.target.info import read_target_info
    from eagle3.artifacts.workdir import WorkDir

    if target is None:
        from eagle3.demo.targets import build_target

        target = build_target("smollm2", ROOT / "work" / "targets" / "smollm2-135m")  # does nothing when built
    data = work / "chats.jsonl"
    data.write_text("".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines(True)[:chats]))
    prep = work / "prep"
    prepare_dataset(PrepareConfig(work_dir=prep, target_model=str(target), data=[str(data)], max_length=1024,
                                  eval_fraction=0.0, num_workers=1))
    wds, rates = {}, {}
    for name in ENCODINGS:
        workdir = work / name
        shutil.copytree(prep / "01_dataset", workdir / "01_dataset")
        t0 = time.perf_counter()
        m = extract_hidden_states(ExtractConfig(work_dir=workdir, target_model=str(target), backend="hf",
                                                samples_per_file=64, store_dtype=name))
        rates[name] = (m.counts["train_tokens"] + m.counts["eval_tokens"]) / (time.perf_counter() - t0)
        wds[name] = workdir
    ref = store.HiddenStateStore.open(WorkDir(wds["bf16"]), needed_by="bench")
    f8 = store.HiddenStateStore.open(WorkDir(wds["fp8"]), needed_by="bench")
    info = read_target_info(str(target))
    head = load_lm_head(info).float()  # [V, H]
    H, A = ref.hidden_size, ref.num_aux
    names = [f"aux layer {k}" for k in ref.aux_layers] + ["final"]
    schemes = {"fp8 store (own run)": None, "store's pow2 (4H+13)": pow2_fp8, "bf16 amax/256 (4H+17)": bf16_scale_fp8,
               "f32 amax/448 (4H+25)": f32_scale_fp8, f"pow2/b{BLOCK} (4H+4H/{BLOCK}+9)": block_fp8}
    errs = {k: {s: [] for s in schemes} for k in names}
    agree = total = same_argmax = 0
    kl = []
    a, b = ref.split("train"), f8.split("train")
    for i in range(len(a)):
        x, y = a[i], b[i]
        xs = list(x.aux.view(-1, A, H).unbind(1)) + [x.final]  # A+1 x [T, H]
        ys = list(y.aux.view(-1, A, H).unbind(1)) + [y.final]
        for k, xa, ya in zip(names, xs, ys):
            for scheme, fn in schemes.items():
                errs[k][scheme].append(token_error(ya if fn is None else fn(xa), xa))
        m = store.label_positions(x.loss_mask, torch.tensor([0, x.num_tokens]))
        same_argmax += int((x.target_argmax[m] == y.target_argmax[m]).sum())
        if m.any():
            lx = x.final[m].float() @ head.T  # [k, V]
            ly = y.final[m].float() @ head.T
            agree += int((lx.argmax(-1) == ly.argmax(-1)).sum())
            total += int(m.sum())
            px = torch.log_softmax(lx, -1)
            kl.append((px.exp() * (px - torch.log_softmax(ly, -1))).sum(-1))  # [k] KL(bf16 || fp8)
    tokens = len(torch.cat(next(iter(errs[names[0]].values()))))
    out = [f"== quality on {target} ({info.num_layers} layers, H={H}): {len(a)} samples, {tokens:,} tokens, "
           f"stage 02 (hf backend) per encoding",
           "stage 02 tokens/s (model load included): " + ", ".join(f"{n} {r:,.0f}" for n, r in rates.items()),
           "per-token relative L2 error against the bf16 store, median / p90 / max:",
           f"{'tensor':14s}" + "".join(f"{s:>27s}" for s in schemes)]
    for k in names:
        out.append(f"{k:14s}" + "".join(f"{_summary(torch.cat(v)):>27s}" for v in errs[k].values()))
    kl_all = torch.cat(kl) if kl else torch.zeros(0)
    out.append(f"teacher softmax(final @ lm_head.T) at {total:,} labelled positions, fp8 store vs bf16 store: "
               f"top-1 agreement {100 * agree / max(total, 1):.2f}%, KL(bf16 || fp8) mean {kl_all.mean().item():.2e} "
               f"nats, p99 {kl_all.quantile(0.99).item() if len(kl_all) else float('nan'):.2e}")
    out.append(f"stored target_argmax (from the bf16 final state in both encodings) equal in the two stage 02 runs at "
               f"{100 * same_argmax / max(total, 1):.2f}% of those positions: below 100%, the runs' forwards differed")
    return out


# --------------------------------------------------------------------------- 4. served


def served(config: Path, work: Path, formats: list[str]) -> list[str]:
    from eagle3.artifacts.workdir import WorkDir
    from eagle3.core.config import load_yaml

    src = WorkDir(work)
    if not src.manifest("prepare").is_file():
        raise SystemExit(f"{src.manifest('prepare')} is missing: run stages 00-01 of {config} first "
                         f"(bash scripts/demo.sh runs them).")
    upstream = [s for s in ("generate", "prepare") if src.manifest(s).is_file()]  # configs without stage 00 too
    rows = []
    for name in formats:
        workdir = WorkDir(Path(f"{work}-store-{name}"))
        for stage in upstream:
            if not workdir.stage_dir(stage).exists():
                shutil.copytree(src.stage_dir(stage), workdir.stage_dir(stage))
        times = {}
        for script, extra in (("02", ["--store-dtype", name]), ("03", []), ("04", []), ("05", []), ("06", [])):
            path = next(ROOT.glob(f"{script}_*.py"))
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(path), "--config", str(config), "--work-dir", str(workdir.root), *extra],
                           cwd=ROOT, check=True)
            times[script] = time.perf_counter() - t0
        r = json.loads(workdir.evaluate_results().read_text())
        m02 = json.loads(workdir.manifest("extract").read_text())
        rows.append((name, r, m02, times))
    K = load_yaml(config).get("evaluate", {}).get("num_speculative_tokens")
    out = [f"== served acceptance per store encoding ({config}, K={K}; stages 02-06 in {work}-store-*)",
           f"{'encoding':10s}{'store MB':>10s}{'B/token':>9s}{'served L (95%)':>20s}  {'per position':24s}"
           f"{'expected L (held-out)':>22s}{'02 s':>7s}{'04 s':>7s}"]
    for name, r, m02, times in rows:
        ci = r.get("acceptance_length_ci95")
        L = f"{r['acceptance_length']:.3f} ±{ci:.3f}" if ci is not None else f"{r['acceptance_length']:.3f}"
        per = " ".join(f"{p:.2f}" for p in r.get("acceptance_per_position") or [])
        exp = (r.get("expected_accept_length_training") or {}).get("value")
        out.append(f"{name:10s}{m02['counts']['bytes'] / 1e6:>10.1f}{m02['counts']['bytes_per_token']:>9,}{L:>20s}  "
                   f"{per:24s}{exp if exp is None else f'{exp:.3f}':>22}{times['02']:>7.0f}{times['04']:>7.0f}")
    ref = next((r for n, r, _, _ in rows if n == "bf16"), None)
    if ref is not None and ref.get("acceptance_length_ci95") is not None:
        lo = ref["acceptance_length"] - ref["acceptance_length_ci95"]
        hi = ref["acceptance_length"] + ref["acceptance_length_ci95"]
        for n, r, _, _ in rows:
            if n != "bf16":
                inside = lo <= r["acceptance_length"] <= hi
                out.append(f"{n}: served {r['acceptance_length']:.3f} {'inside' if inside else 'OUTSIDE'} bf16's "
                           f"95% interval [{lo:.3f}, {hi:.3f}]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576, help="synthetic store width (default SmolLM2's)")
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", type=Path, help="HF folder whose states measure the quality (default: the demo's "
                                                "SmolLM2, built at work/targets/smollm2-135m if missing)")
    ap.add_argument("--chats", type=int, default=200, help="demo chats run through the target for the quality part")
    ap.add_argument("--skip-quality", action="store_true", help="only the bytes and speed parts")
    ap.add_argument("--served", action="store_true", help="run stages 02-06 per encoding on a SmolLM2 demo work dir")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml")
    ap.add_argument("--work-dir", type=Path, help="the demo work dir with stages 00-01 done (default: the config's)")
    ap.add_argument("--formats", default=",".join(ENCODINGS))
    a = ap.parse_args()
    from eagle3.core.logs import setup_logging

    setup_logging(logging.WARNING)
    def show(lines: list[str]) -> None:
        print("\n".join(lines) + "\n", flush=True)

    if a.served:
        from eagle3.core.config import load_yaml

        work = a.work_dir or Path(load_yaml(a.config)["work_dir"])
        show(served(a.config, work, [f for f in a.formats.split(",") if f]))
        return
    show(bytes_table())
    show(speed(a.hidden, a.tokens, a.files, a.repeats))
    if not a.skip_quality:
        with tempfile.TemporaryDirectory() as tmp:
            show(quality(a.target, a.chats, Path(tmp)))


if __name__ == "__main__":
    main()
