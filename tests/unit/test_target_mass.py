"""Tests for eagle3/stages/s04_train/target_mass.py: the draft rows' share of the target's
distribution, and that the whole lm_head is read once per run and let go after each pass."""
import torch

import eagle3.stages.s04_train.target_mass as target_mass
from eagle3.stages.s04_train.target_mass import HeldOutMass, draft_vocab_mass, head_dtype


def test_the_mass_is_the_softmax_share_of_the_draft_rows_in_any_chunking(monkeypatch):
    g = torch.Generator().manual_seed(0)
    final = torch.randn(2, 5, 8, generator=g)
    head = torch.randn(30, 8, generator=g)
    draft = torch.tensor([1, 4, 5, 17, 29])
    want = torch.softmax(final @ head.T, dim=-1)[..., draft].sum(-1)  # [2, 5]
    got = draft_vocab_mass(final, head, draft)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    monkeypatch.setattr(target_mass, "LOGITS_CHUNK_BYTES", 3 * 4 * 30)  # 3 positions per chunk: 10 = 3+3+3+1
    torch.testing.assert_close(draft_vocab_mass(final, head, draft), want)
    assert torch.equal(draft_vocab_mass(final, head, torch.arange(30)), torch.ones(2, 5))  # all rows: all mass


def test_the_head_is_read_once_and_released_after_a_pass():
    g = torch.Generator().manual_seed(1)
    head = torch.randn(12, 4, generator=g)
    loads = []
    mass = HeldOutMass(lambda: loads.append(1) or head, torch.tensor([0, 3, 7]), torch.device("cpu"))
    a, b = torch.randn(1, 6, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    first = mass([0, 1], a)
    mass([2], b)
    assert len(loads) == 1
    mass.release()
    assert mass.lm_head is None
    assert mass([0, 1], a) is first and len(loads) == 1  # a later pass: the kept masses, no read
    mass([5], b)  # a batch not seen before (another --eval-batches): read again
    assert len(loads) == 2
    torch.testing.assert_close(first, draft_vocab_mass(a, head, torch.tensor([0, 3, 7])))
    assert 0 < float(first.min()) and float(first.max()) < 1


def test_the_head_is_bf16_on_a_gpu_and_float32_on_a_cpu():
    assert head_dtype(torch.device("cuda", 3)) == torch.bfloat16  # a device object only: no GPU touched
    assert head_dtype(torch.device("cpu")) == torch.float32


def test_a_bf16_head_gives_the_float32_heads_mass_within_bf16_rounding():
    """What the GPU branch computes, run on the CPU: the bf16 head's mass stays near the float32 one."""
    g = torch.Generator().manual_seed(2)
    head, final = torch.randn(64, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    ids = torch.tensor([1, 4, 9, 16, 25, 36, 49])
    exact = draft_vocab_mass(final, head, ids)
    torch.testing.assert_close(draft_vocab_mass(final, head.to(torch.bfloat16), ids), exact, atol=0.02, rtol=0.05)
