"""Tiny targets built offline and deterministically, for the demo and the tests.

    python -m eagle3.demo.tiny --kind llama --out work/targets/tiny-llama

builds a folder that loads like a hub checkpoint: `config.json`,
`model.safetensors`, and a byte-level BPE tokenizer (trained here on the shipped
chat set) with a Llama-3 style chat template. Kinds:

- `llama`: `LlamaForCausalLM`.
- `deepseek_v3`: `DeepseekV3ForCausalLM` with MLA and MoE, as Kimi-K2 uses.
- `kimi_k25`: the same text model nested as Kimi-K2.5 is: sizes under
  `text_config`, weights under `language_model.`, a tiny `vision_config` and
  `preprocessor_config.json`, what vLLM's own `KimiK25ForConditionalGeneration` reads to
  serve it text only (tests/e2e/test_kimi_vllm.py).

`--train-steps N` then trains the random model for N steps of next-token
prediction on the shipped chats (packed rows, `TRAIN_RECIPE`), so the demo's
target is a teacher with predictable continuations: a random target's greedy
output is noise no drafter can learn, and one trained 20 steps answers every
prompt with newlines. 150 steps give a teacher whose answers a drafter learns to
predict (its served acceptance: docs/results.md). Tests use untrained targets (faster, same shapes), except the
end-to-end test, which trains 60 steps.

Sizes are chosen so vLLM's CPU build runs them too (head_dim 64; MLA with
kv_lora_rank 512 and qk_rope_head_dim 64; noaux_tc routing): other MLA
sizes fail at engine start on the CPU build.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from eagle3.artifacts.atomic import atomic_path
from eagle3.artifacts.workdir import REPO_ROOT
from eagle3.core.logs import setup_logging
from eagle3.drafter.cpu import bf16_pays

log = logging.getLogger(__name__)

KINDS = ("llama", "deepseek_v3", "kimi_k25")

DEMO_CHATS = REPO_ROOT / "data" / "demo_chats.jsonl"
MARKER = "TINY_TARGET.json"  # written last into a built target: its recipe (and final loss)

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOT, "<|pad|>"]
# Llama-3's template shape: header tokens around the role, content trimmed, <|eot_id|>
# closing every turn, and the assistant header as generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Kimi-K2.5's vision tower at a tiny size, under transformers' Kimi_K25VisionConfig field
# names (what vLLM 0.32's MoonViT reads, model_executor/models/kimi_k25_vit.py). vLLM builds
# the tower's modules even when it serves the text model only (on the meta device, as
# placeholders), so the config must be complete; the folder holds no weights for it.
TINY_VISION = {"patch_size": 14, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "intermediate_size": 128, "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2]}
# Kimi-K2.5's preprocessor_config.json at the tiny vision size. vLLM 0.32 reads it even when it
# serves the text model only: deciding whether any modality is served builds the class's
# processing info (model_executor/models/kimi_k25.py `KimiK25ProcessingInfo`), which loads this
# image processor (its fused CPU one, transformers_utils/processors/kimi_k25_vision_fused.py,
# when numba is importable). Never used to process an image here.
TINY_PREPROCESSOR = {"media_proc_cfg": {
    "patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 1024, "patch_limit_on_one_side": 64, "fixed_output_tokens": None,
    "in_patch_limit_each_frame": 256, "in_patch_limit_video": None}}
TOKENIZER_VOCAB = 2048  # the BPE trainer's target; the model's vocab is padded to a multiple of 64


def _corpus_lines(path: Path = DEMO_CHATS) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        rec = json.loads(raw)
        for m in rec.get("messages") or rec.get("conversations") or []:
            lines.append(m.get("content") or m.get("value") or "")
    return lines


def build_tokenizer(chats: Path = DEMO_CHATS):
    """A byte-level BPE tokenizer trained on `chats`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus_lines(chats), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=BOS, eos_token=EOT, pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE, model_max_length=4096)
    return tok


def padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def llama_config(vocab_size: int, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        dtype="float32")


def deepseek_v3_config(vocab_size: int, tok):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        dtype="float32")


def build_model(kind: str, tok, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    vocab = padded_vocab(len(tok))
    cfg = llama_config(vocab, tok) if kind == "llama" else deepseek_v3_config(vocab, tok)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


# The demo teacher's training recipe (see train_on_chats): the shipped chats are ~33K
# tokens, so 150 steps of 16 x 256 packed tokens are ~19 passes, enough for the
# 5M-parameter model to reproduce the chat templates.
TRAIN_RECIPE = {"batch_size": 16, "seq_len": 256, "lr": 5e-3, "packing": "stream"}


def chat_token_ids(tok, chats: Path = DEMO_CHATS) -> list[list[int]]:
    """Every chat of `chats` rendered with the tokenizer's chat template, as token ids."""
    seqs = []
    for raw in chats.read_text().splitlines():
        rec = json.loads(raw)
        if "messages" in rec:
            msgs = rec["messages"]
        else:
            role = {"human": "user", "gpt": "assistant", "system": "system"}
            msgs = [{"role": role[m["from"]], "content": m["value"]} for m in rec["conversations"]]
        text = tok.apply_chat_template(msgs, tokenize=False)
        seqs.append(tok.encode(text, add_special_tokens=False))
    return seqs


def packed_rows(seqs: list[list[int]], seq_len: int):
    """The chats laid end to end (each starts with BOS) and cut into rows of seq_len.

    Packing instead of padding: the chats average ~80 tokens, so padded batches would
    spend most of their compute on pad positions. Attention runs across chat boundaries,
    as in ordinary LM pretraining; each chat opens with BOS, which is where the served
    prompts start too.
    """
    import torch

    stream = [t for s in seqs for t in s]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"{len(stream)} tokens of chats do not fill one row of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)  # [n, seq_len]


def train_on_chats(model, tok, steps: int, seed: int = 0, chats: Path = DEMO_CHATS,
                   batch_size: int = TRAIN_RECIPE["batch_size"], seq_len: int = TRAIN_RECIPE["seq_len"],
                   lr: float = TRAIN_RECIPE["lr"]) -> list[float]:
    """Next-token training on the packed chats; returns the loss curve (one value per step).

    Epochs walk a fresh permutation of the rows, so every chat is seen equally often.
    AdamW at a high rate (a tiny model, a tiny corpus) with warmup and cosine decay to 10%.
    """
    import math

    import torch
    from tqdm import tqdm

    rows = packed_rows(chat_token_ids(tok, chats), seq_len)  # [N, seq_len]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    bf16 = bf16_pays()
    order: list[int] = []
    losses = []
    model.train()
    bar = tqdm(range(steps), desc="train tiny target", unit="step")
    for step in bar:
        if len(order) < batch_size:
            order += torch.randperm(len(rows), generator=g).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        ids = rows[idx]  # [B, seq_len]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {float(loss)} at step {step} training the tiny target; "
                               f"lower lr (now {lr})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def save_target(kind: str, model, tok, out: Path, recipe: dict, report: dict | None = None) -> None:
    """Write the folder atomically: a half-built target is never mistaken for one."""
    from safetensors.torch import load_file, save_file

    with atomic_path(out) as tmp:
        tok.save_pretrained(tmp)
        if kind == "kimi_k25":
            text = model.config.to_dict()
            cfg = {
                "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": text, "vision_config": TINY_VISION, "vocab_size": text["vocab_size"],
                "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
                "tie_word_embeddings": False,  # transformers' Kimi_K25Config defaults to True
            }
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
            (tmp / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2, sort_keys=True))
            # The checkpoint's names, as save_pretrained writes them (transformers 5 fuses the routed
            # experts in memory, `experts.down_proj` [E, ...]; a checkpoint, Kimi-K2.5's too, keeps
            # one `experts.<e>.down_proj.weight` per expert, which is what vLLM's loader maps), nested
            # under `language_model.` as Kimi-K2.5's are.
            plain = tmp / "text-model"
            model.save_pretrained(plain, safe_serialization=True)
            state = {}
            for shard in sorted(plain.glob("*.safetensors")):
                state.update({f"language_model.{k}": v.contiguous() for k, v in load_file(shard).items()})
            shutil.rmtree(plain)
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        # `recipe` alone decides whether a later build reuses this folder; `report` (the
        # final loss) is for reading only, so it stays out of the comparison.
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "recipe": recipe, **(report or {})}) + "\n")


def build_tiny_target(kind: str, out: Path | str, seed: int = 0, force: bool = False,
                      train_steps: int = 0) -> Path:
    assert kind in KINDS, f"unknown tiny target kind {kind!r}; one of {KINDS}"  # the CLI offers KINDS only
    out = Path(out)
    marker = out / MARKER
    recipe = {"kind": kind, "seed": seed, "train_steps": train_steps}
    if kind == "kimi_k25":  # a folder of the fused in-memory expert names is rebuilt
        recipe["expert_names"] = "per-expert"
    if train_steps:  # a changed recipe must rebuild a trained target, not reuse the old one
        recipe["train"] = TRAIN_RECIPE
    if marker.is_file() and not force and json.loads(marker.read_text()).get("recipe") == recipe:
        log.info("tiny %s target already at %s", kind, out)
        return out
    tok = build_tokenizer()
    model = build_model(kind, tok, seed)
    losses = train_on_chats(model, tok, train_steps, seed) if train_steps else []
    save_target(kind, model, tok, out, recipe=recipe, report={"final_loss": losses[-1] if losses else None})
    log.info("built tiny %s target at %s (vocab %d, %d layers%s)", kind, out, model.config.vocab_size,
             model.config.num_hidden_layers,
             f", trained {train_steps} steps: loss {losses[0]:.2f} -> {losses[-1]:.2f}" if losses else ", untrained")
    return out


def main(argv: list[str] | None = None) -> None:

    p = argparse.ArgumentParser(description="Build a tiny target model folder for the demo and tests.")
    p.add_argument("--kind", choices=KINDS, default="llama")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    p.add_argument("--train-steps", type=int, default=0,
                   help="train the random model on the shipped chats for this many steps (the --tiny demo "
                        "uses 150)")
    a = p.parse_args(argv)
    setup_logging()
    build_tiny_target(a.kind, a.out, a.seed, a.force, a.train_steps)


if __name__ == "__main__":
    main()
