"""Plausible bugs, one at a time, in a copy of the tree: which test catches each?

    python bench/mutations.py [--ref REF] [--tier unit|e2e] [--only NAME,...]
                              [--first-only | --all-unit | --together] [--why] [--list]

Each mutation below is an exact text substitution in one file (a check deleted, a
comparison loosened, an exponent off by one). The harness copies the tree into a
temporary folder (the working tree's tracked and untracked, not ignored files; or, with
`--ref`, the tree of that commit), applies each substitution there, never in the working
tree, runs pytest, and puts the file back before the next one:

  1. the test files of the mutated module first (`first`): the likely catchers, seconds;
  2. if those pass, the rest of tests/unit. A mutation of tier `e2e` is caught only by a
     test in tests/e2e (one that imports vLLM, or runs stages end to end): its `first`
     files alone run.

It prints one row per mutation: name, file, the failing test ids (or SURVIVED, and
where), and seconds. A substitution whose original text does not occur exactly once
stops the run before any test: the list must move with the code. The unmutated copy's
`first` files run once at the start; a failure there stops the run (a catch would then
mean nothing). Bytecode is off: a same-length edit within a second could else be read
from a stale .pyc.

`--first-only` stops at step 1 (quick, while writing a test); `--why` prints where each
failure stopped and its first `E` line; `--all-unit` runs step 2 for e2e mutations too (does the
quick tier catch them?). `--together` applies every selected mutation at once and runs
tests/unit once: a cheap check that the tier misses them all (one mutation may in
principle hide another's failure, so the one-at-a-time rows are the verdict).
Exit status: 1 when a mutation survived, 2 on a harness error.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = "tests/unit"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    first: tuple[str, ...]  # test files (relative to the root) to run before the rest of the tier
    tier: str = "unit"  # "e2e": needs a tests/e2e test (vLLM, or stages end to end); only `first` runs


LOSS_MASK = ("tests/unit/test_loss_mask.py",)
TTT = ("tests/unit/test_ttt.py",)
ENGINE_RULES = ("tests/unit/test_engine_rules.py",)
STORE = ("tests/unit/test_store.py", "tests/unit/test_store_encodings.py", "tests/unit/test_store_identity.py")
MANIFEST = ("tests/unit/test_manifest.py", "tests/unit/test_records.py")
CONFIG = ("tests/unit/test_config.py",)
VOCAB_MAP = ("tests/unit/test_vocab_map.py", "tests/unit/test_vocab_selection.py")
VLLM_RULES = ("tests/e2e/test_vllm_layer_rules.py",)
TRAIN_WINDOWS = ("tests/unit/test_train_windows.py",)
TRAIN_CHECKPOINT = ("tests/unit/test_train_checkpoint.py",)
WINDOWS_PROCESSES = ("tests/e2e/test_windows_processes.py",)
PRODUCERS = ("tests/unit/test_window_producers.py",)

MUTATIONS: tuple[Mutation, ...] = (
    # build_samples: a turn continues the sample only if its prompt extends the sample so far
    Mutation("loss_mask: a rewritten history continues the sample", "eagle3/target/loss_mask.py",
             "if not samples or not _is_prefix(samples[-1].ids, prompt):", "if not samples:", LOSS_MASK),
    Mutation("loss_mask: a turn rendered unlike its prompt is not refused", "eagle3/target/loss_mask.py",
             "        if not _is_prefix(prompt, upto):\n            raise BadRecord(",
             "        if False:\n            raise BadRecord(", LOSS_MASK),
    Mutation("loss_mask: fuzzy_ends never counted", "eagle3/target/loss_mask.py",
             "            fuzzy_ends += 1\n", "            pass\n", LOSS_MASK),
    Mutation("ttt: padded positions learnable", "eagle3/drafter/ttt.py",
             "learn = loss_mask.bool() & real", "learn = loss_mask.bool()", TTT),
    Mutation("check_drafter: d2t out of range not flagged", "eagle3/serving/drafter_check.py",
             'if s["out_of_range"]:', "if False:", ENGINE_RULES),
    Mutation("check_drafter: d2t duplicates not flagged", "eagle3/serving/drafter_check.py",
             'if s["duplicates"]:', "if False:", ENGINE_RULES),
    Mutation("check_drafter: vocab_size other than the target's", "eagle3/serving/drafter_check.py",
             "if self.V is not None and self.V != target.vocab_size:", "if False:", ENGINE_RULES),
    Mutation("check_drafter: target_hidden_size other than the target's", "eagle3/serving/drafter_check.py",
             "if self.Ht is not None and self.Ht != target.hidden_size:", "if False:", ENGINE_RULES),
    Mutation("check_drafter: hidden_size other than the target's (no embedding)", "eagle3/serving/drafter_check.py",
             "if self.H is not None and self.H != target.hidden_size and EMBED_NAME not in self.loaded:",
             "if False:", ENGINE_RULES),
    Mutation("check_drafter: short context accepted", "eagle3/serving/drafter_check.py",
             "if mpe is None or mpe < target.max_position_embeddings:", "if mpe is None:", ENGINE_RULES),
    Mutation("store: file_problem accepts a file that grew", "eagle3/artifacts/store/format.py",
             'if size != entry["bytes"]:', 'if size < entry["bytes"]:', STORE),
    Mutation("store: file_checksum hashes the first chunk only", "eagle3/artifacts/store/format.py",
             "            h.update(block)\n", "            h.update(block)\n            break\n", STORE),
    Mutation("store: buffer_checksum hashes the first chunk only", "eagle3/artifacts/store/format.py",
             "h.update(mv[a:a + chunk])", "h.update(mv[a:chunk])", STORE),
    Mutation("store: fp8 decode (exponent add) one exponent off", "eagle3/artifacts/store/format.py",
             "exponent = (scale_log2.numpy().astype(np.int16) << 7)[:, None]",
             "exponent = ((scale_log2.numpy().astype(np.int16) + 1) << 7)[:, None]", STORE),
    Mutation("store: fp8 decode (float path) one exponent off", "eagle3/artifacts/store/format.py",
             "return (q.to(torch.float32) * _pow2(scale_log2)[:, None]).to(dtype)",
             "return (q.to(torch.float32) * _pow2(scale_log2.to(torch.int32) + 1)[:, None]).to(dtype)", STORE),
    Mutation("store: a file of the other encoding is read", "eagle3/artifacts/store/reader.py",
             "if self.layout.encoding != encoding:", "if False:", STORE),
    Mutation("read_manifest: a newer format version accepted", "eagle3/artifacts/manifest.py",
             "if m.format_version != FORMAT_VERSION:", "if m.format_version < FORMAT_VERSION:", MANIFEST),
    Mutation("read_manifest: a deleted output accepted", "eagle3/artifacts/manifest.py",
             '        if not f.is_file():\n            return f"{f} is missing"\n        if f.stat().st_size != info',
             '        if not f.is_file():\n            continue\n        if f.stat().st_size != info', MANIFEST),
    Mutation("read_manifest: a truncated output accepted", "eagle3/artifacts/manifest.py",
             'if f.stat().st_size != info["bytes"]:', 'if f.stat().st_size > info["bytes"]:', MANIFEST),
    Mutation("coerce: 100.5 becomes int 100", "eagle3/core/config.py",
             "            if tp is int and isinstance(value, float) and not value.is_integer():\n"
             "                raise ValueError(value)\n", "", CONFIG),
    Mutation("coerce: an unknown string becomes a bool", "eagle3/core/config.py",
             "                    return False\n                raise ValueError(value)\n",
             "                    return False\n", CONFIG),
    Mutation("vocab_map: numpy offsets read as target ids", "eagle3/artifacts/vocab_map.py",
             "return np.arange(d2t.size, dtype=np.int64) + d2t.reshape(-1).astype(np.int64)",
             "return d2t.reshape(-1).astype(np.int64)", VOCAB_MAP),
    Mutation("vocab_map: compare_mappings ignores a length difference", "eagle3/artifacts/vocab_map.py",
             " + abs(a.draft_vocab_size - b.draft_vocab_size)", "", VOCAB_MAP),
    Mutation("vocab_map: coverage of nothing counted is 0", "eagle3/artifacts/vocab_map.py",
             'if total else float("nan")', "if total else 0.0", VOCAB_MAP),
    Mutation("windows: a round's checksums never verified", "eagle3/stages/s04_train/windows.py",
             "problem = store.file_problem(d, entry, verify_checksum=True)",
             "problem = store.file_problem(d, entry, verify_checksum=False)", TRAIN_WINDOWS),
    Mutation("checkpoint: the identity check turned off", "eagle3/stages/s04_train/checkpoint.py",
             "if ckpt.identity != identity:", "if False:", TRAIN_CHECKPOINT),
    Mutation("read_checkpoint: torch.load(weights_only=False)", "eagle3/artifacts/train_outputs.py",
             'data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)',
             'data = torch.load(path, map_location="cpu", weights_only=False, mmap=True)', TRAIN_CHECKPOINT),
    # the e2e config of tests/e2e/test_windows.py saves every step, which hides it
    Mutation("train: a round's end not forced to save", "eagle3/stages/s04_train/run.py",
             "if is_best or candidate or self.step % cfg.save_every == 0 or end or part_end:",
             "if is_best or candidate or self.step % cfg.save_every == 0 or end:", WINDOWS_PROCESSES, "e2e"),
    # Both were caught only by tests/e2e/test_windows.py (two producers, a trainer) until the
    # producer's functions got unit tests of their own.
    Mutation("windows: the budget check leaves out the round's own bytes", "eagle3/stages/s02_extract/windowed.py",
             "rounds = set(present) | {round_no}", "rounds = set(present) - {round_no}", PRODUCERS),
    Mutation("windows: producers skip the next untrained round", "eagle3/stages/s02_extract/windowed.py",
             "and round_no >= trained]", "and round_no > trained]",
             PRODUCERS),
    Mutation("checkpoints: --keep-evaluated 1 spares the newest evaluated file too",
             "eagle3/stages/s04_train/checkpoint.py",
             "[-keep_evaluated:]) if keep_evaluated > 1 else set()",
             "[-keep_evaluated:]) if keep_evaluated > 0 else set()", ("tests/unit/test_train_checkpoint.py",)),
    Mutation("checkpoints: --keep-evaluated N spares one too many", "eagle3/stages/s04_train/checkpoint.py",
             "if s <= current)[-keep_evaluated:])", "if s <= current)[-keep_evaluated - 1:])",
             ("tests/unit/test_train_checkpoint.py",)),
    Mutation("selection: a tie goes to the earlier checkpoint", "eagle3/stages/s06_evaluate/selection.py",
             'key=lambda r: (r["acceptance_length"], r["step"])', 'key=lambda r: (r["acceptance_length"], -r["step"])',
             ("tests/unit/test_checkpoint_selection.py",)),
    Mutation("layer rules: vLLM V1 takes an empty top-level list", "eagle3/serving/engine_rules.py",
             "ids = [int(k) for k in top] if top else (nested or None)",
             "ids = [int(k) for k in top] if top is not None else (nested or None)", VLLM_RULES, "e2e"),
    Mutation("layer rules: vLLM V2 reads the nested eagle ids", "eagle3/serving/engine_rules.py",
             'v2_nested = ec.get("layer_ids") if isinstance(ec, Mapping) else None',
             'v2_nested = (ec.get("layer_ids") or ec.get("eagle_aux_hidden_state_layer_ids")) '
             'if isinstance(ec, Mapping) else None', VLLM_RULES, "e2e"),
)


class HarnessError(Exception):
    pass


def copy_tree(dst: Path, ref: str | None) -> None:
    """The tree under test, without caches: the working tree's files, or commit `ref`'s."""
    if ref:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
        return
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "-co", "--exclude-standard"],
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():  # a deleted but still tracked file is skipped
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def substitute(text: str, m: Mutation) -> str:
    n = text.count(m.old)
    if n != 1:
        raise HarnessError(f"{m.file}: the original text of mutation {m.name!r} occurs {n} times (want exactly "
                           f"once); update MUTATIONS in {Path(__file__).name} to the code:\n{m.old}")
    return text.replace(m.old, m.new)


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
# the first "E   " line of a failure, and the line of the test it stopped at
WHY = re.compile(r"^(E  .*)$(?:\n.*)*?^(tests/\S+:\d+): ", re.M)
SHOW_WHY = False  # --why: also print where each failure stopped and its first E line


def pytest(tree: Path, paths: list[str]) -> tuple[list[str], int]:
    """The failing (or erroring) test ids of `paths` run in `tree`, and pytest's exit code."""
    # No bytecode: a substitution of the same length within the same second could otherwise
    # be read from a stale .pyc (its check is the source's mtime in seconds and its size).
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *paths]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode not in (0, 1):  # 2-5: interrupted, internal error, usage error, nothing collected
        raise HarnessError(f"pytest {' '.join(paths)} exited {r.returncode} in {tree}:\n{r.stdout[-3000:]}"
                           f"{r.stderr[-2000:]}")
    if SHOW_WHY:
        for e_line, where in WHY.findall(r.stdout):
            print(f"    {where}  {e_line[:300]}", flush=True)
    return FAILED.findall(r.stdout), r.returncode


def run_one(tree: Path, m: Mutation, first_only: bool = False, all_unit: bool = False) -> tuple[list[str], float]:
    """Apply `m` in `tree`, find what catches it, restore the file."""
    path = tree / m.file
    original = path.read_text()
    path.write_text(substitute(original, m))
    t0 = time.perf_counter()
    try:
        first = [f for f in m.first if (tree / f).is_file()]
        caught = pytest(tree, first)[0] if first else []
        if not caught and (m.tier == "unit" or all_unit) and not first_only:
            rest = sorted(str(p.relative_to(tree)) for p in (tree / UNIT).glob("test_*.py"))
            rest = [f for f in rest if f not in first]
            caught = pytest(tree, rest)[0]
    finally:
        path.write_text(original)
    return caught, time.perf_counter() - t0


def table(rows: list[tuple[str, str, str, float]]) -> str:
    lines = ["| mutation | file | caught by | s |", "|---|---|---|---:|"]
    lines += [f"| {n} | {f} | {c} | {s:.0f} |" for n, f, c, s in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", help="test the tree of this commit (default: the working tree)")
    ap.add_argument("--only", help="comma-separated substrings of mutation names")
    ap.add_argument("--together", action="store_true", help="all mutations at once, one run of tests/unit")
    ap.add_argument("--first-only", action="store_true",
                    help="only each mutated module's own test files (quick; a survivor is then not a tier verdict)")
    ap.add_argument("--tier", choices=("unit", "e2e"), help="only the mutations of this tier")
    ap.add_argument("--all-unit", action="store_true",
                    help="after its own files, run tests/unit for every mutation, e2e ones too (does the quick "
                         "tier catch them?)")
    ap.add_argument("--why", action="store_true", help="print where each failure stopped and its first E line")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = ap.parse_args()
    global SHOW_WHY
    SHOW_WHY = args.why
    chosen = [m for m in MUTATIONS if (not args.tier or m.tier == args.tier)
              and (not args.only or any(s.strip() in m.name for s in args.only.split(",")))]
    if args.list:
        for m in chosen:
            print(f"{m.tier:4}  {m.file:32}  {m.name}")
        return 0
    with tempfile.TemporaryDirectory(prefix="eagle3-mutations-") as tmp:
        tree = Path(tmp)
        copy_tree(tree, args.ref)
        for m in chosen:  # every substitution must still apply before any time is spent
            substitute((tree / m.file).read_text(), m)
        if args.together:
            for m in chosen:
                path = tree / m.file
                path.write_text(substitute(path.read_text(), m))
            t0 = time.perf_counter()
            failed, _ = pytest(tree, [UNIT])
            print(f"{len(chosen)} mutations applied together; tests/unit in {time.perf_counter() - t0:.0f} s: "
                  + (f"{len(failed)} failed:\n  " + "\n  ".join(failed) if failed else "every test passed"))
            return 0 if failed else 1
        baseline = sorted({f for m in chosen for f in m.first if (tree / f).is_file()})
        failed, _ = pytest(tree, baseline)
        if failed:
            raise HarnessError("the unmutated tree fails " + ", ".join(failed) + ": fix that first")
        rows = []
        for m in chosen:
            caught, secs = run_one(tree, m, args.first_only, args.all_unit)
            ran = [f for f in m.first if (tree / f).is_file()]
            if args.first_only or (m.tier == "e2e" and not args.all_unit):
                where = " (" + (", ".join(ran) if ran else "no test file of it in this tree") + ")"
            else:
                where = " (tests/unit)"
            rows.append((m.name, m.file, ", ".join(caught) if caught else "SURVIVED" + where, secs))
            print(f"{'caught' if caught else 'SURVIVED':8} {secs:5.0f} s  {m.name}", flush=True)
    print()
    print(table(rows))
    survived = sum(r[2].startswith("SURVIVED") for r in rows)
    print(f"\n{len(rows) - survived} of {len(rows)} caught ({'--ref ' + args.ref if args.ref else 'working tree'})")
    return 1 if survived else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HarnessError as e:
        print(f"mutations.py: {e}", file=sys.stderr)
        sys.exit(2)
