"""Which positions of the train split carry loss, counted before the first step.

Stage 04 refuses a train split where no position carries loss (it would train on
nothing and still write a drafter), warns when more than half of the samples or of
the assistant positions carry none, and leaves samples without any out of its epochs
(a row of them would be an optimizer step on no gradient).

Reads, per store file of the split, only the `sample_offsets`, `loss_mask` and
`target_argmax` columns (5 bytes a token; the hidden states are neither mapped nor
checksummed here: training checks each file's checksum when it first reads it).
Writes nothing; `Trainer` logs the counts and records them in stage 04's manifest.

The rule is step 0 of `valid_positions` in eagle3/drafter/ttt.py (docs/CONVENTIONS.md §4),
counted per predicted token j of a sample (drafter position t = j - 2): token j
carries loss iff j < --max-seq-len (training crops samples there), loss_mask[j] is 1
(an assistant token) and the target's argmax at j - 1 is in the draft vocabulary.
With --loss-on all every token counts as inside the mask (the held-out split still
scores assistant tokens only); where stage 02 stored no argmax (it computes it next to
assistant tokens only), the target's argmax over the draft rows stands in, which the
draft vocabulary can always say. The first two tokens of a sample are never predicted and are not counted. Every
counted position falls under exactly one reason:

    beyond_max_seq_len   j >= --max-seq-len
    outside_mask         loss_mask[j] == 0
    outside_vocab        loss_mask[j] == 1, the target's argmax at j - 1 not in the draft vocab
    carrying             the rest
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eagle3.artifacts.store import FileLayout, SplitView, file_name
from eagle3.core.errors import PipelineError


@dataclass
class LossPositions:
    """Counts over the valid samples of one split, in the split's sample order."""

    source: str  # the store folder (what a message names)
    positions: int  # predicted tokens (j >= 2) of all samples, before cropping
    beyond_max_seq_len: int
    outside_mask: int
    outside_vocab: int
    assistant: int  # predicted tokens with loss_mask 1, cropped or not
    per_sample: np.ndarray  # [S] int64: loss-carrying positions of each sample

    @property
    def carrying(self) -> int:
        return self.positions - self.beyond_max_seq_len - self.outside_mask - self.outside_vocab

    @property
    def samples(self) -> int:
        return len(self.per_sample)

    @property
    def samples_without_loss(self) -> int:
        return int((self.per_sample == 0).sum())

    def trainable(self) -> list[int]:
        """Split indices of the samples with at least one loss-carrying position."""
        return np.flatnonzero(self.per_sample > 0).tolist()

    def summary(self, max_seq_len: int, draft_vocab: int) -> str:
        """The counts by reason, in one line (no newline: it goes into error messages)."""
        return (f"{self.samples} samples ({self.samples_without_loss} with no loss-carrying position), "
                f"{self.positions} predicted positions: {self.beyond_max_seq_len} beyond --max-seq-len "
                f"{max_seq_len}, {self.outside_mask} outside the assistant mask, {self.outside_vocab} with the "
                f"target's argmax outside the draft vocabulary of {draft_vocab} tokens, {self.carrying} "
                f"carrying loss ({self.assistant} assistant positions in all)")

    def to_json(self) -> dict:
        return {"samples": self.samples, "samples_without_loss": self.samples_without_loss,
                "positions": self.positions, "beyond_max_seq_len": self.beyond_max_seq_len,
                "outside_mask": self.outside_mask, "outside_vocab": self.outside_vocab,
                "assistant": self.assistant, "carrying": self.carrying}


def _column(path, lay: FileLayout, name: str, dtype, count: int) -> np.ndarray:
    return np.fromfile(path, dtype=dtype, count=count, offset=lay.offset(name))


def count_loss_positions(split: SplitView, t2d: torch.Tensor, max_seq_len: int,
                         assistant_only: bool = True) -> LossPositions:
    """Count the positions of `split` by the reason they do or do not carry loss.

    t2d: [V_t] bool, the draft vocabulary the run trains (stage 03's, or with
    --init-from and --vocab-mode keep the drafter's own). assistant_only=False
    (--loss-on all): every token may carry loss, so none falls outside the mask.
    """
    in_vocab = t2d.detach().cpu().numpy().astype(bool)  # [V_t]
    V = len(in_vocab)
    totals = dict(positions=0, beyond_max_seq_len=0, outside_mask=0, outside_vocab=0, assistant=0)
    per_sample = []
    for entry in split.files:  # the order SplitView numbers its samples in
        path = split.store.dir / file_name(split.split, entry["file_no"])
        lay, _ = FileLayout.read(path)
        S, T = lay.num_samples, lay.num_tokens
        offsets = _column(path, lay, "sample_offsets", np.int64, S + 1)  # [S+1]
        assistant = _column(path, lay, "loss_mask", np.int8, T).astype(bool)  # [T]
        mask = assistant if assistant_only else np.ones(T, dtype=bool)  # [T]
        argmax = _column(path, lay, "target_argmax", np.int32, T)  # [T], -1 where never a label
        sample = np.repeat(np.arange(S), np.diff(offsets))  # [T] sample of each token
        j = np.arange(T) - offsets[:-1][sample]  # [T] index of each token within its sample
        prev = np.concatenate([[-1], argmax[:-1]])  # [T] argmax at j - 1 (same sample wherever j >= 2)
        said = (prev >= 0) & (prev < V)
        said[said] = in_vocab[prev[said]]  # [T] the draft vocab can say the target's prediction of j
        if not assistant_only:  # stage 02 stored no argmax outside the answers: the draft rows' own stands in
            said |= prev < 0
        valid = np.ones(S, dtype=bool)
        valid[list(entry["rejected"])] = False  # rejected samples are not in the split
        predicted = (j >= 2) & valid[sample]  # [T]
        within = predicted & (j < max_seq_len)
        carry = within & mask & said  # [T]
        totals["positions"] += int(predicted.sum())
        totals["beyond_max_seq_len"] += int((predicted & ~within).sum())
        totals["outside_mask"] += int((within & ~mask).sum())
        totals["outside_vocab"] += int((within & mask & ~said).sum())
        totals["assistant"] += int((predicted & assistant).sum())
        per_sample.append(np.bincount(sample[carry], minlength=S)[valid])  # [S_valid]
    counts = np.concatenate(per_sample) if per_sample else np.zeros(0, dtype=np.int64)
    assert len(counts) == len(split), (len(counts), len(split))
    return LossPositions(str(split.store.dir), per_sample=counts, **totals)


def check_loss_positions(positions: LossPositions, *, max_seq_len: int, draft_vocab: int, mapping_from: str) -> str | None:
    """Refuse a split where nothing carries loss (one line: the store, the counts, the fix).
    Returns the warning to log (the same counts) when more than half of the samples or
    of the assistant positions carry none, else None."""
    counts = positions.summary(max_seq_len, draft_vocab)
    if positions.carrying == 0:
        within_mask = positions.positions - positions.beyond_max_seq_len - positions.outside_mask  # assistant positions inside the crop
        if positions.samples == 0:
            fix = "the store's train split holds no sample: rerun stages 01 and 02 on training data"
        elif within_mask > 0:
            fix = (f"the draft vocabulary ({mapping_from}) never holds the target's prediction: check that stage 03 "
                   f"ran on this store's data and target, or raise --draft-vocab-size in stage 03; with "
                   f"--init-from, --vocab-mode remap trains under stage 03's mapping")
        elif positions.assistant > 0:
            fix = (f"every assistant token lies beyond --max-seq-len {max_seq_len}: raise --max-seq-len (and "
                   f"--batch-tokens with it) to reach the answers")
        else:
            fix = ("stage 01's loss mask marks no assistant token: check that the records hold assistant turns "
                   "and rerun stages 01-03")
        raise PipelineError(f"{positions.source}: no position of the train split carries loss [{counts}]; {fix}.")
    dropped = positions.assistant - positions.carrying
    if 2 * positions.samples_without_loss > positions.samples or 2 * dropped > positions.assistant:
        return (f"{positions.source}: more than half of the train split carries no loss ({positions.samples_without_loss} of "
                f"{positions.samples} samples, {dropped} of {positions.assistant} assistant positions) [{counts}]; samples without a "
                f"loss-carrying position are left out of training. Raise --max-seq-len, or the draft vocabulary in "
                f"stage 03, to train on more of the data")
    return None
