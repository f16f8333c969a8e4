"""eagle3/stages/s04_train/data_source.py: what both data sources share, on a plan of
synthetic lengths: the data position a checkpoint records, and the warning of a resume
whose checkpoint stood elsewhere in the data. No store, no stage; well under a second.
The two sources end to end: tests/stages/test_train_schedule.py (the whole split),
tests/e2e/test_windows.py and test_windows_processes.py (the rounds)."""
import logging
from types import SimpleNamespace

from eagle3.stages.s04_train.data import Batching, EpochPlan
from eagle3.stages.s04_train.data_source import DataSource
from eagle3.stages.s04_train.distributed import Dist


class Planned(DataSource):
    """The base's behaviour over one EpochPlan (what WholeSplit adds is the store)."""

    def __init__(self, plan: EpochPlan):
        super().__init__(SimpleNamespace(), Dist())
        self.plan = plan
        self.total = plan.steps_for_epochs(2)

    def micro_batches(self, step: int) -> list[list[int]]:
        return self.plan.micro_batches(step)


def source() -> Planned:
    lengths = [(13 * i) % 90 + 10 for i in range(120)]
    return Planned(EpochPlan(lengths, Batching(256, 128, seed=5), rank=0, world=1, grad_accum=1))


def test_the_position_after_a_step_is_its_epoch_and_the_steps_done_in_it():
    data = source()
    first = data.plan.steps_in(0)
    assert data.position(0) == {"epoch": 0, "batch_in_epoch": 0}
    assert data.position(1) == {"epoch": 0, "batch_in_epoch": 1}
    assert data.position(first) == {"epoch": 0, "batch_in_epoch": first}  # epoch 0 just ended
    assert data.position(first + 1) == {"epoch": 1, "batch_in_epoch": 1}
    assert data.position(data.total) == {"epoch": 1, "batch_in_epoch": data.total - first}


def test_a_whole_split_goes_on_at_the_checkpoints_step_and_warns_when_its_data_stood_elsewhere(caplog):
    data = source()
    step = data.plan.steps_in(0) + 2
    here = SimpleNamespace(step=step, **data.position(step))
    elsewhere = SimpleNamespace(step=step, epoch=0, batch_in_epoch=step)
    with caplog.at_level(logging.WARNING):
        assert data.resume_step(here, "ckpt.pt") == step
        assert not caplog.records
        assert data.resume_step(elsewhere, "ckpt.pt") == step
    assert f"records data position {{'epoch': 0, 'batch_in_epoch': {step}}}" in caplog.text
    # What only the rounds do: nothing to wait for, nothing deleted, no round counted.
    assert data.ready(step) and not data.ends_part(data.total) and data.rounds_trained(data.total) == 0
    assert data.resumed(here, "ckpt.pt") is here
