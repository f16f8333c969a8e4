"""Stage 04's config: the drafter's shape, the unroll, the optimizer, the schedule."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.config import StageConfig, param
from eagle3.core.errors import PipelineError
from eagle3.drafter.shape import SHAPES
from eagle3.drafter.losses import LossSpec
from eagle3.stages.s04_train.trackers import CHOICES as TRACKER_CHOICES
from eagle3.stages.s04_train.trackers import check_report_to

VOCAB_MODES = ("keep", "remap")
PRECISIONS = ("auto", "bf16", "fp32")
ATTENTIONS = ("sdpa", "reference")
LOSS_ON = ("assistant", "all")


@dataclass(kw_only=True)
class TrainConfig(StageConfig):
    work_dir: Path = param(help="work directory (stages 01-03 must have run in it)")
    target_model: str = param(help="target model folder or hub id (its embedding and lm_head rows are read)")
    # drafter shape; None = take the target's value
    num_attention_heads: int | None = param(None, help="drafter attention heads (default: the target's)")
    num_key_value_heads: int | None = param(None, help="drafter kv heads (default: the target's, or heads)")
    head_dim: int | None = param(None, help="drafter head dim (default: hidden / heads; 128 for DeepSeek/Kimi "
                                            "targets, a size FlashInfer serves)")
    intermediate_size: int | None = param(None, help="drafter MLP width (default: the target's dense width)")
    drafter_shape: str | None = param(None, choices=tuple(SHAPES), identity_unless_default=True,
                                      help="eagle3, or eagle3.1 (an RMSNorm per aux layer before fc, the post-norm "
                                           "state fed to the next step; vLLM >= 0.22, SGLang >= 0.5.12). Default: "
                                           "eagle3, or with --init-from the drafter's own")
    # train-time test
    ttt_steps: int = param(7, min=1, help="draft steps unrolled per position (EAGLE-3 uses 7)")
    step_decay: float = param(0.8, help="loss weight of step k is step_decay**k")
    loss: str = param("kl", identity_unless_default=True,
                      help="each step's loss: kl (forward KL, the default), tv (total variation: 1 - the "
                           "acceptance rate under sampling), lk_alpha or lk_lambda (the LK losses, arXiv "
                           "2602.23881), or a weighted mix such as kl:0.1,tv:0.9 (docs/LEVERS.md, \"The loss\")")
    lk_eta: float = param(3.0, min=0.0, identity_unless_default=True,
                          help="lk_lambda's eta: KL's weight is exp(-eta * the step's mean acceptance), the rest "
                               "goes to tv")
    # what the drafter learns from (docs/LEVERS.md measures each)
    loss_on: str = param("assistant", choices=LOSS_ON,
                         help="positions that carry loss in training: assistant tokens only, or every token (the "
                              "target's distribution is known at prompt tokens too); held-out figures stay "
                              "assistant-only")
    aux_noise: float = param(0.0, min=0.0, help="Gaussian noise on the aux hidden states in training, its std a "
                                                "share of each layer's per-token RMS (0: none)")
    init_layer: int | None = param(None, help="initialise the drafter's decoder layer from this target layer "
                                              "(-1: the last; needs the target's attention and MLP shapes)")
    init_head: bool = param(False, help="start fc (passing the deepest aux layer), the final norm and lm_head as "
                                        "the target's own (its final norm and draft-vocab lm_head rows)")
    train_fraction: float = param(1.0, gt=0, max=1.0,
                                  help="train on this share of the train split's samples, the first of a seeded "
                                       "order (a smaller share is a subset of a larger one): data forecasts")
    # optimization
    learning_rate: float = param(1e-4, gt=0, help="peak AdamW learning rate")
    weight_decay: float = param(0.0, help="AdamW weight decay")
    warmup_steps: int = param(50, help="linear warmup steps, then cosine decay to min_lr_ratio * lr")
    warmup_ratio: float | None = param(None, min=0.0, max=1.0,
                                       help="warmup as a share of the planned steps (wins over warmup_steps)")
    min_lr_ratio: float = param(0.1, help="final learning rate as a share of the peak")
    epochs: int = param(1, min=1, help="passes over the train split (ignored when max_steps is set)")
    max_steps: int | None = param(None, help="optimizer steps in total (default: from epochs)")
    batch_tokens: int = param(8192, min=1, help="tokens per micro-batch per process (padded ones too without "
                                                "packing)")
    max_seq_len: int = param(2048, min=1, help="samples are cropped to this many tokens")
    grad_accum: int = param(1, min=1, help="micro-batches per optimizer step")
    grad_clip: float = param(0.5, help="clip the gradient norm to this")
    packing: bool = param(True, help="pack several samples per row (block-diagonal attention, no padding); "
                                     "false: right-padded batches")
    attention: str = param("sdpa", choices=ATTENTIONS,
                           help="TTT attention: sdpa (fused kernel, memory linear in the row length) or "
                                "reference (materialises each step's score block)")
    checkpoint_steps: bool = param(False, identity=False,
                                   help="recompute each TTT step's activations in backward (less memory, "
                                        "about one more forward of compute)")
    precision: str = param("auto", choices=PRECISIONS,
                           help="auto = bf16 autocast on GPU and on CPUs with AMX/AVX512-BF16, else fp32")
    seed: int = param(0, help="seed of initialisation and data order")
    # evaluation, logging, checkpoints
    log_every: int = param(10, identity=False, help="steps between log lines")
    eval_every: int = param(100, identity=False, help="steps between held-out evaluations")
    eval_batches: int | None = param(None, identity=False, help="cap on held-out batches per evaluation")
    report_to: list[str] = param(default_factory=lambda: ["auto"], identity=False,
                                 help=f"trackers fed metrics.jsonl's keys and steps, comma-separated: "
                                      f"{', '.join(TRACKER_CHOICES)} (auto: tensorboard when installed)")
    save_every: int = param(200, identity=False, help="steps between checkpoints")
    keep_checkpoints: int = param(2, identity=False, help="step checkpoints kept besides the best one")
    keep_evaluated: int = param(1, min=1, identity=False,
                                help="held-out evaluated checkpoints kept, the newest N, for stage 06's "
                                     "--select-checkpoint to serve (1: only best.pt, no extra files; N > 1 saves a "
                                     "checkpoint at every evaluation)")
    # fine-tuning an existing drafter
    init_from: str | None = param(None, help="start from this drafter folder (SGLang/EAGLE format)")
    vocab_mode: str = param("keep", choices=VOCAB_MODES, help="with --init-from: keep the drafter's own d2t, or "
                                                              "remap its lm_head rows into stage 03's mapping")
    allow_bad_start: bool = param(False, identity=False,
                                  help="continue although the starting held-out loss is worse than uniform")
    # windows of the store (stage 02's --disk-budget; eagle3/stages/s04_train/windows.py)
    keep_windows: bool = param(False, identity=False, help="over windows: keep each round's folder after the "
                               "checkpoint that covers it (default: delete it then)")
    window_wait_s: float = param(0.0, min=0.0, identity=False, help="over windows: seconds to wait for the next "
                                 "round to be complete before stopping (a trainer fed by other boxes)")
    windows_dir: str | None = param(None, identity=False, help="over windows: where stage 02 writes the rounds "
                                    "(default 02_hidden_states/windows; the shared mount of several boxes)")
    # runtime
    device: str = param("auto", identity=False, help="auto, cpu, cuda")
    dist_timeout_s: float = param(3600.0, gt=0, identity=False,
                                  help="under torchrun: seconds a rank waits in a collective for the others before "
                                       "the run fails (torch's defaults: 30 min gloo, 10 min NCCL). What can hold "
                                       "the others that long: a window's checksums (each rank reads its share), "
                                       "rank 0 writing a checkpoint (docs/OPERATIONS.md)")
    prefetch: int = param(2, min=0, identity=False,
                          help="micro-batches loaded ahead in a background thread (pinned memory, fp8 decoded on "
                               "the GPU); 0: load each in the training thread. The weights are the same either way")
    stop_after: int | None = param(None, identity=False,
                                   help="exit after this step, as if killed (for resume tests)")
    force: bool = param(False, identity=False, help="discard existing checkpoints and train from scratch")
    take_over_stale_s: float | None = param(None, min=0.0, identity=False, help="take over 04_train from a "
                                            "trainer on another box whose heartbeat has not changed for this many "
                                            "seconds, watched from here (at least 90). Default: never; a trainer "
                                            "whose process is gone on this machine is replaced without it")

    def __post_init__(self):
        super().__post_init__()  # the choices and ranges declared with the fields
        check_report_to(self.report_to)
        self.loss = str(self.loss_spec())  # one spelling per loss in the manifest: `kl:1` is `kl`
        if self.vocab_mode == "remap" and not self.init_from:
            raise PipelineError("vocab_mode = 'remap' only applies with --init-from DRAFTER_DIR.")
        if (self.init_layer is not None or self.init_head) and self.init_from:
            raise PipelineError("--init-layer / --init-head start a fresh drafter from the target's weights; "
                                "--init-from starts from an existing drafter: pass one of them.")
        if self.batch_tokens < self.max_seq_len:
            raise PipelineError(f"batch_tokens = {self.batch_tokens} is below max_seq_len = {self.max_seq_len}; "
                                f"a batch must hold one full sample: raise --batch-tokens or lower --max-seq-len.")

    def loss_spec(self) -> LossSpec:
        """--loss and --lk-eta as the TTT loop takes them (a clear error for a bad --loss)."""
        return LossSpec.parse(self.loss, self.lk_eta, source=f"{type(self).__name__}.loss (--loss)")
