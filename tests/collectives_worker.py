"""One rank of tests/stages/test_collectives.py, started by `torchrun --nproc-per-node 2` (CPU, gloo).

    python -m torch.distributed.run --nproc-per-node 2 tests/collectives_worker.py SCENARIO OUT_DIR

Each rank writes OUT_DIR/rank{R}.json: what it observed, or the error it met.

Scenarios:
    cuda_group   stage 04's process-group setup for a CUDA training device, then the
                 held-out metric reduction. torch cannot make an NCCL group on a CPU
                 machine, so `dist.init_process_group` is wrapped: the group is made with
                 gloo on exactly the device types the requested backend serves (torch's
                 own BackendConfig: "nccl" -> "cuda:gloo", "cpu:gloo,cuda:nccl" ->
                 "cpu:gloo,cuda:gloo"), so it refuses tensors on the device types the
                 real group would refuse, with the real group's error. `device_id` (which
                 a CPU build of torch rejects) and `torch.cuda.set_device` are recorded.
    foreign      a group created before stage 04 that serves CUDA only ("cuda:gloo"): the
                 seam must refuse a host tensor by name on a machine without a GPU.
    rng          every rank's RNG state gathered for rank 0 to write, then restored per rank.
    rounds       stage 04 over windows (`Rounds.ensure`) where a round is complete for
                 rank 0 and not (yet) for rank 1 after --window-wait-s, then where rank 1
                 finds the round damaged: both ranks must make the same choice.
    release      stage 04 over windows: both ranks open round 0 (a real round folder, `Rounds.ensure`)
                 and read samples of both its files, then call `Rounds.covered` at the round's
                 end. At the moment rank 0 deletes the round, neither rank may map a file of
                 it (each rank's /proc/PID/maps): on NFS a mapped file stays as .nfsXXXX and
                 keeps its folder.
    uneven       a drafter wrapped as stage 04 wraps it (`wrap_ddp`); rank 0 runs two
                 held-out forwards, rank 1 none, then both sum their counts, as a held-out
                 evaluation whose batches do not divide evenly does. The group's timeout is
                 60 s, so a forward that is a collective fails here instead of hanging.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from eagle3.core.cli import leave_without_teardown  # noqa: E402

K = 3


def rank_metrics(rank: int) -> list[dict]:
    """Two batches of per-step metrics that differ by rank (what TTTOutput.metrics holds)."""
    out = []
    for b in range(2):
        m = {"num_valid": 10 + 7 * rank + b}
        for k in range(K):
            m[f"loss_{k}"] = 1.0 + 0.5 * rank + 0.1 * b + 0.01 * k
            m[f"ce_{k}"] = 2.0 + 0.5 * rank + 0.1 * b + 0.01 * k
            m[f"full_acc_{k}"] = 0.5 / (k + 1) + 0.1 * rank - 0.05 * b
        out.append(m)
    return out


def same_device_types_on_gloo(backend: str) -> str:
    served = dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    return ",".join(f"{device}:gloo" for device in served)


def cuda_group(rank: int, local_rank: int) -> dict:
    seen: dict = {"set_device": []}
    real_init = dist.init_process_group

    def init(backend=None, *args, device_id=None, **kwargs):
        seen.update(backend=str(backend), device_id=None if device_id is None else str(device_id),
                    emulated=same_device_types_on_gloo(str(backend)))
        return real_init(seen["emulated"], *args, **kwargs)

    dist.init_process_group = init
    torch.cuda.set_device = lambda device: seen["set_device"].append(str(torch.device("cuda", device)
                                                                         if isinstance(device, int) else device))
    from eagle3.stages.s04_train.metrics import MetricSum
    from eagle3.stages.s04_train.run import init_distributed

    d = init_distributed(torch.device("cuda", local_rank))
    seen.update(world=d.world, rank=d.rank)
    acc = MetricSum(K)
    for m in rank_metrics(rank):
        acc.add(m)
    try:
        acc.all_reduce(d.world)
        seen["result"] = acc.result()
    except RuntimeError as e:
        seen["error"] = str(e).splitlines()[0]
    return seen


def foreign(rank: int, local_rank: int) -> dict:
    from eagle3.core.errors import PipelineError
    from eagle3.stages.s04_train.distributed import all_reduce_sum

    dist.init_process_group("cuda:gloo")
    try:
        all_reduce_sum(torch.ones(3, dtype=torch.float64))
        return {"error": None}
    except PipelineError as e:
        return {"error": str(e)}


def rng(rank: int, local_rank: int) -> dict:
    from eagle3.stages.s04_train.checkpoint import rng_states_of_all_ranks, set_rng_state
    from eagle3.stages.s04_train.distributed import init_distributed

    cpu = torch.device("cpu")
    d = init_distributed(cpu)
    torch.manual_seed(1000 + rank)  # each rank's generator in its own state
    torch.rand(rank + 1)
    states = rng_states_of_all_ranks(cpu)
    expected = torch.rand(4)  # what this rank draws next in an unbroken run
    torch.manual_seed(7)  # a fresh process of the resumed run
    set_rng_state(states, d.rank, d.world, cpu)
    resumed = torch.rand(4)
    return {"entries": len(states), "entries_differ": not torch.equal(states[0]["torch"], states[1]["torch"]),
            "expected": expected.tolist(), "resumed": resumed.tolist()}


def uneven(rank: int, local_rank: int) -> dict:
    import warnings
    from datetime import timedelta

    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3.drafter.ttt import TTTConfig, TTTModel
    from eagle3.stages.s04_train.distributed import all_reduce_sum, wrap_ddp

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    c = DrafterConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                      target_hidden_size=32, draft_vocab_size=16, target_vocab_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(c)
    t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
    t2d[::4] = True  # draft token i is target token 4 i
    drafter.set_vocab_mapping(torch.arange(c.draft_vocab_size) * 3, t2d)  # offsets: i + 3 i = 4 i
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = wrap_ddp(TTTModel(drafter, TTTConfig(num_steps=2)), torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    T = 12
    ids = torch.randint(c.draft_vocab_size, (1, T), generator=g) * 4  # [1, T] target ids in the draft vocab
    aux = torch.randn(1, T, 3 * c.target_hidden_size, generator=g)
    embed = torch.randn(c.target_vocab_size, c.hidden_size, generator=g)
    probs = torch.softmax(torch.randn(1, T, c.draft_vocab_size, generator=g), -1)
    forwards = 2 if rank == 0 else 0
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(forwards):
                model(aux, ids, embed, probs, torch.roll(ids, -1, 1), torch.ones(1, T), None, None, None)
        total = all_reduce_sum(torch.tensor([float(forwards)], dtype=torch.float64))
        error = None
    except RuntimeError as e:  # gloo's timeout: a rank waited in a collective the other never entered
        total, error = torch.tensor([-1.0]), str(e).splitlines()[0]
    return {"total": float(total[0]), "error": error,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def rounds(rank: int, local_rank: int) -> dict:
    import tempfile
    from datetime import timedelta

    from eagle3.artifacts.workdir import WorkDir
    from eagle3.core.errors import PipelineError
    from eagle3.stages.s04_train.windows import Rounds

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))

    class Schedule:  # the run's step 40 is round 1's first
        total = 80

        def locate(self, step):
            return (step // 40, step % 40)

    def opened_by_rank_0_only(r):
        if rank == 0:
            found.current = r
        return rank == 0

    def damaged_for_rank_1(r):
        if rank == 1:
            raise PipelineError(f"stage 04: round {r} is damaged (a file's checksum differs)")
        found.current = r
        return True

    found = Rounds(WorkDir(Path(tempfile.mkdtemp())), None, Schedule(), windows_dir=None, keep=False, wait_s=0.5,
                   rank=rank, world=2)
    found._open = opened_by_rank_0_only
    goes_on = found.ensure(40)
    current = found.current
    found._open = damaged_for_rank_1
    try:
        found.ensure(40)
        error = None
    except PipelineError as e:
        error = str(e)
    return {"goes_on": goes_on, "current": current, "damaged_error": error}


def release(rank: int, local_rank: int, out: Path) -> dict:
    from datetime import timedelta

    from fixtures import train_checkpoint
    from round_stores import MAIN, write_round

    from eagle3.artifacts import windows
    from eagle3.artifacts.workdir import WorkDir
    from eagle3.stages.s04_train.checkpoint import save_checkpoint
    from eagle3.stages.s04_train.windows import Rounds, mapped_files

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    workdir, wdir = WorkDir(out / "work"), out / "windows"
    folder = wdir / windows.round_name(0)
    if rank == 0:
        write_round(wdir, 0)
        save_checkpoint(workdir, train_checkpoint({}, {}, step=4, rounds_trained=1), keep=2, is_best=False)
    dist.barrier()

    class Schedule:  # rounds of 4 steps
        total, starts = 8, [0, 4]

        def locate(self, step):
            return (step // 4, step % 4)

        def end(self, r):
            return 4 * (r + 1)

        def rounds_done(self, step):
            return step // 4

    rounds = Rounds(workdir, MAIN, Schedule(), windows_dir=str(wdir), keep=False, wait_s=10, rank=rank, world=2)
    assert rounds.ensure(0)
    tokens = [rounds.split[i].num_tokens for i in (rank, 2 + rank)]  # a sample of each file: both mapped
    mapped_before = mapped_files(folder)
    pids = [None] * 2
    dist.all_gather_object(pids, os.getpid())
    seen: dict = {"mapped_at_deletion": None}
    real_delete = windows.delete_round

    def delete_round(wdir_, r):  # rank 0, at the deletion: what does each rank map of the round?
        held = []
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            held += [f"pid {pid}: {line.split()[-1]}" for line in maps if str(folder.resolve()) in line]
        seen["mapped_at_deletion"] = held
        return real_delete(wdir_, r)

    windows.delete_round = delete_round
    rounds.covered(4, workdir.checkpoint(4))
    dist.barrier()  # rank 1 stays alive (and would keep its mappings) until rank 0 has deleted
    return {"tokens": tokens, "mapped_before": len(mapped_before), **seen, "deleted": not folder.exists(),
            "progress": windows.read_progress(wdir)["trained_rounds"]}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    try:
        scenarios = {"cuda_group": cuda_group, "foreign": foreign, "rng": rng, "rounds": rounds, "uneven": uneven,
                     "release": lambda rank, local_rank: release(rank, local_rank, out)}
        result = scenarios[scenario](rank, local_rank)
    except Exception:  # noqa: BLE001 - the test shows what any rank met
        result = {"crash": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        # Both ranks have written their answer before either tears its gloo pairs down: a
        # rank that closes its sockets while the other is still in the last collective, or
        # whose transport threads are destroyed during the interpreter's shutdown, can abort
        # ("terminate called without an active exception", seen once in CI as rank 1's
        # SIGABRT after a passing scenario). The answer is on disk; nothing is left to run.
        if "cpu" in dist.BackendConfig(dist.get_backend()).get_device_backend_map():
            dist.barrier()  # (the "foreign" group serves no host tensors and so has no barrier)
        dist.destroy_process_group()
    leave_without_teardown()  # as a stage's torchrun rank does (eagle3/core/cli.py)


if __name__ == "__main__":
    main()
