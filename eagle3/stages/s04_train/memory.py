"""Stage 04's memory model: predicted peak memory per GPU, and the measurement behind it.

Pure arithmetic over the drafter's shape and the training settings; reads and
writes nothing. `predict_peak` is what stage 04 logs at its start (on any device)
and what bench/bench_memory.py checks against `measure_saved_bytes`, which counts
the bytes autograd keeps for backward (saved-tensor hooks, each storage once) in
one real forward on the CPU.

What is counted, for one process training with bf16 autocast (what GPUs run):

    weights          fp32 master weights, 4 bytes per parameter
    grads            fp32, 4 per parameter
    adamw            two fp32 moments, 8 per parameter
    bf16 copies      autocast's bf16 copy of each matmul weight, kept for backward
                     (not fc's: its input, the aux states, needs no gradient)
    embedding        the frozen target embedding [V_t, H] and the draft lm_head rows
                     [V_d, H], bf16
    batch            the micro-batch's inputs: aux states, final state (bf16) and the
                     target's draft-vocab distribution (fp32 [tokens, V_d])
    activations      bytes autograd keeps per token (`saved_bytes_per_token`) x tokens
    backward peak    the largest transient of backward: the bf16 logits gradient of
                     one step ([tokens, V_d]; the blocked loss makes it block by block),
                     plus one step's activations recomputed when steps are checkpointed
    ddp buckets      under torchrun: DDP's fp32 gradient buckets, 4 per parameter

Activations per token and per TTT step, from the tensors autograd saves (checked
against a measurement by tests/unit/test_memory.py and bench/bench_memory.py):

    sdpa       28 H + 8 I + 4 (nh + n_kv + 1) D + 4 nh + 2 V_d + 28
               (2 V_d: the bf16 logits the blocked loss keeps, `losses.soft_cross_entropy`)
    reference  the same + (6 nh + 1) T: the fp32 scores, their bf16 copy and the
               mask of a [T, T] block per step, T the row length (quadratic per row)
    checkpointed steps keep only each step's inputs: 2 H + 8, and 4 n_kv D for the
               keys/values of all but the last step

plus, once per token, 2 A H_t (the bf16 copy of the aux input of `fc`). Allocator
fragmentation, CUDA context and communication buffers are not counted; keep
headroom (stage 04 warns above 85% of the device).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from eagle3.drafter.model import DrafterConfig
from eagle3.drafter.ttt import TTTConfig, ttt_loss

GIB = 1024**3


def param_count(drafter_config: DrafterConfig) -> tuple[int, int]:
    """(all trainable parameters, those in matmul weights) of the drafter."""
    H, I, D = drafter_config.hidden_size, drafter_config.intermediate_size, drafter_config.head_dim
    nh, nkv = drafter_config.num_attention_heads, drafter_config.num_key_value_heads
    matmul = (drafter_config.num_aux_layers * drafter_config.target_hidden_size * H  # fc
              + 2 * H * (nh + 2 * nkv) * D  # q, k, v read 2H
              + nh * D * H  # o_proj
              + 3 * H * I  # gate, up, down
              + drafter_config.draft_vocab_size * H)  # lm_head
    norms = 4 * H  # input_layernorm, hidden_norm, post_attention_layernorm, norm
    return matmul + norms, matmul


def bf16_copy_bytes(drafter_config: DrafterConfig) -> int:
    """Autocast's bf16 weight copies that backward keeps: every matmul weight but fc's."""
    return 2 * (param_count(drafter_config)[1] - drafter_config.num_aux_layers * drafter_config.target_hidden_size * drafter_config.hidden_size)


def step_bytes_per_token(drafter_config: DrafterConfig, attention: str, row_len: int, checkpoint_steps: bool) -> float:
    """Bytes autograd keeps per token for one TTT step under bf16 autocast (module doc)."""
    H, I, D = drafter_config.hidden_size, drafter_config.intermediate_size, drafter_config.head_dim
    nh, nkv, V = drafter_config.num_attention_heads, drafter_config.num_key_value_heads, drafter_config.draft_vocab_size
    if checkpoint_steps:  # the step's hidden input, its valid indices and the kv later steps read
        return 2 * H + 8 + 4 * nkv * D
    b = 28 * H + 8 * I + 4 * (nh + nkv + 1) * D + 4 * nh + 2 * V + 28
    if attention == "reference":
        b += (6 * nh + 1) * row_len
    return float(b)


def saved_bytes_per_token(drafter_config: DrafterConfig, ttt_steps: int, attention: str, row_len: int,
                          checkpoint_steps: bool = False, fp32_attention: bool = False) -> float:
    """Activations kept for backward per training token, all K steps together.

    `fp32_attention`: the sdpa attention runs in float32 because the fused CPU kernel
    refuses bf16 on this CPU (`not eagle3.drafter.cpu.bf16_fused_attention_ok()`, e.g. under
    ATEN_CPU_CAPABILITY=default): step j then keeps float32 copies of its query (less the
    bf16 keys it no longer keeps) and of the j + 1 cached keys and values it reads.
    Fitted on measurements at four attention shapes and K = 3, 5 (exact at each)."""
    once = 2 * drafter_config.num_aux_layers * drafter_config.target_hidden_size
    total = once + ttt_steps * step_bytes_per_token(drafter_config, attention, row_len, checkpoint_steps)
    if checkpoint_steps:  # the last step's keys/values are read by no later step
        total -= 4 * drafter_config.num_key_value_heads * drafter_config.head_dim
    elif fp32_attention and attention == "sdpa":
        nh, nkv, D, K = drafter_config.num_attention_heads, drafter_config.num_key_value_heads, drafter_config.head_dim, ttt_steps
        total += K * (6 * nh - 4 * nkv) * D + 4 * nkv * D * K * (K + 1)
    return total


@dataclass
class PeakEstimate:
    """Predicted peak bytes per process, by term (module doc); `total` sums them."""

    weights: float
    grads: float
    adamw: float
    bf16_copies: float
    embedding: float
    batch: float
    activations: float
    backward_peak: float
    ddp_buckets: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f) for f in self.__dataclass_fields__)

    def summary(self) -> str:
        terms = ", ".join(f"{f.replace('_', ' ')} {getattr(self, f) / GIB:.1f}" for f in self.__dataclass_fields__)
        return f"{self.total / GIB:.1f} GiB ({terms})"


def predict_peak(drafter_config: DrafterConfig, *, ttt_steps: int, batch_tokens: int, row_len: int, attention: str = "sdpa",
                 checkpoint_steps: bool = False, ddp: bool = False, fp32_attention: bool = False) -> PeakEstimate:
    """Peak memory of one process training on micro-batches of `batch_tokens` tokens in
    rows of `row_len` tokens (only the reference attention depends on it: its blocks
    span a whole row, padded or packed). `ddp`: DistributedDataParallel's gradient
    buckets, another fp32 copy of the gradients. `fp32_attention`: see `saved_bytes_per_token`."""
    P, _ = param_count(drafter_config)
    V, H = drafter_config.draft_vocab_size, drafter_config.hidden_size
    steps = step_bytes_per_token(drafter_config, attention, row_len, False)
    acts = batch_tokens * saved_bytes_per_token(drafter_config, ttt_steps, attention, row_len, checkpoint_steps, fp32_attention)
    transient = batch_tokens * (2 * V + (steps if checkpoint_steps else 0))
    return PeakEstimate(
        weights=4 * P, grads=4 * P, adamw=8 * P, bf16_copies=bf16_copy_bytes(drafter_config),
        embedding=2 * (drafter_config.target_vocab_size + V) * H,
        batch=batch_tokens * (2 * drafter_config.num_aux_layers * drafter_config.target_hidden_size + 2 * H + 4 * V + 8 * 4),
        activations=acts, backward_peak=transient, ddp_buckets=4 * P if ddp else 0.0)


def measure_saved_bytes(fn, exclude: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs (a forward).

    Each storage counts once however often it is saved. Saved tensors are *dropped*
    (the hook keeps only a weak reference), so the forward needs no more memory than
    its working set and `backward` cannot run afterwards. `exclude`: tensors whose
    storages are not activations (the parameters).
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    alive: dict[int, weakref.ref] = {}
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in skip:
            return None
        seen = alive.get(ptr)
        if seen is not None and seen() is not None:  # the same storage, still alive: counted already
            return None
        alive[ptr] = weakref.ref(st)  # a freed storage's address may be reused by a new tensor
        total += st.nbytes()
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        fn()
    return total


def measure_training_forward(drafter, *, row_len: int, ttt_steps: int, rows: int = 1,
                             checkpoint_steps: bool = False, autocast: bool = True, seed: int = 0) -> int:
    """Activation bytes autograd keeps in one `ttt_loss` forward over `rows` rows of
    `row_len` random tokens, every position carrying loss (the upper bound), on the
    drafter's device; the bf16 weight copies are part of the count
    (`bf16_copy_bytes`, once)."""

    c = drafter.config
    dev = next(drafter.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    V = c.draft_vocab_size
    ids = drafter.draft_ids()[torch.randint(V, (rows, row_len), generator=g).to(dev)]  # in the draft vocab
    aux = torch.randn(rows, row_len, c.num_aux_layers * c.target_hidden_size, generator=g).bfloat16().to(dev)
    embed = torch.randn(c.target_vocab_size, c.hidden_size, generator=g, dtype=torch.bfloat16).mul_(0.02).to(dev)
    probs = torch.softmax(torch.randn(rows, row_len, V, generator=g), -1).to(dev)
    amax = torch.roll(ids, -1, 1)
    mask = torch.ones(rows, row_len, device=dev)
    cfg = TTTConfig(num_steps=ttt_steps, checkpoint_steps=checkpoint_steps)

    def fwd():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            ttt_loss(drafter, aux, ids, embed, probs, amax, mask, cfg)

    # The target distribution is the batch's own tensor (`predict_peak`'s batch term), which
    # the loss saves as it is: not an activation.
    return measure_saved_bytes(fwd, exclude=list(drafter.parameters()) + [probs])
