"""Host memory of N ranks resuming from one checkpoint at once: read whole vs memory-mapped.

    python bench/bench_resume_memory.py [--gib 0.5] [--ranks 2]

Writes a checkpoint shaped like stage 04's (fp32 weights and two AdamW moments, 12
bytes per parameter; Kimi-K2.5's drafter makes ~11.6 GB) under a temporary folder, then,
for each way of loading, starts `--ranks` processes that load it at the same moment
with the checkpoint's one reader (eagle3/artifacts/train_outputs.py `read_checkpoint`, memory-mapped)
or with a plain `torch.load`, read every tensor once (what copying them to a GPU does)
and, while all of them still hold it, report from /proc/self/smaps_rollup how much the
load added to their anonymous (private) memory and to their Pss, the resident memory
with shared pages split between the processes that map them. The sum of the Pss
increases is what the checkpoint costs the host over all ranks. One line per way;
figures in GiB.
"""
import argparse
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.artifacts.train_outputs import TrainCheckpoint, read_checkpoint  # noqa: E402

GIB = 2**30


def rollup() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024 / GIB  # kB
    return out


def rank(path: str, mapped: bool, barrier, results) -> None:
    torch.set_num_threads(1)
    before = rollup()
    ckpt = read_checkpoint(Path(path)).to_file() if mapped else torch.load(path, map_location="cpu", weights_only=True)
    total = 0.0
    for group in (ckpt["model"], *ckpt["optimizer"]["state"].values()):
        for t in group.values():
            total += float(t.float().sum())  # every page read once, as a copy to the GPU reads them
    barrier.wait()  # every rank holds its checkpoint now
    r = rollup()
    results.put((r["Anonymous"] - before["Anonymous"], r["Pss"] - before["Pss"], total))
    barrier.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=0.5, help="checkpoint size")
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    n = int(a.gib * GIB / 12)  # parameters: fp32 weights + two fp32 moments
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step_00000002.pt"
        w = torch.randn(n)
        ckpt = TrainCheckpoint(
            model={"w": w}, drafter_config={}, aux_layers=[2, 4, 5],
            optimizer={"state": {0: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}}}, scheduler={},
            step=2, epoch=0, batch_in_epoch=2, batch_geometry={"processes": 1}, rounds_trained=0,
            rng=[{"torch": torch.get_rng_state()}], train_config={},
            identity="bench", best={"expected_accept_length": -1.0, "step": None}, eval={})
        torch.save(ckpt.to_file(), path)
        del ckpt
        del w
        size = path.stat().st_size / GIB
        print(f"checkpoint {size:.2f} GiB, {a.ranks} ranks loading it at once")
        ctx = mp.get_context("spawn")
        for mapped in (False, True):
            barrier, results = ctx.Barrier(a.ranks), ctx.Queue()
            procs = [ctx.Process(target=rank, args=(str(path), mapped, barrier, results)) for _ in range(a.ranks)]
            for proc in procs:
                proc.start()
            got = [results.get(timeout=600) for _ in procs]
            for proc in procs:
                proc.join()
            anon = [g[0] for g in got]
            pss = sum(g[1] for g in got)
            print(f"{'memory-mapped (read_checkpoint)' if mapped else 'read whole (torch.load)':32s} added anonymous "
                  f"memory per rank {min(anon):.2f}-{max(anon):.2f} GiB, added Pss of all ranks {pss:.2f} GiB "
                  f"({pss / size:.2f} x the file)")


if __name__ == "__main__":
    main()
