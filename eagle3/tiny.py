"""Tiny targets built offline and deterministically, for the demo and the tests.

    python -m eagle3.tiny --kind llama --out work/targets/tiny-llama

builds a folder that loads like a hub checkpoint: `config.json`,
`model.safetensors`, and a byte-level BPE tokenizer (trained here on the shipped
chat set) with a Llama-3 style chat template. Kinds:

- `llama`: `LlamaForCausalLM`.
- `deepseek_v3`: `DeepseekV3ForCausalLM` with MLA and MoE, as Kimi-K2 uses.
- `kimi_k25`: the same text model nested as Kimi-K2.5 is: sizes under
  `text_config`, weights under `language_model.`.

`--train-steps N` then trains the random model for N steps of next-token
prediction on the shipped chats, so the demo's target is a teacher with
predictable continuations (a random target's greedy output is noise that no
drafter can learn well). Tests use untrained targets: faster, same shapes.

Sizes are chosen so vLLM's CPU build runs them too (head_dim 64; MLA with
kv_lora_rank 512 and qk_rope_head_dim 64; noaux_tc routing): see DESIGN.md.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from .atomic import atomic_path

log = logging.getLogger(__name__)

KINDS = ("llama", "deepseek_v3", "kimi_k25")
REPO = Path(__file__).resolve().parent.parent
DEMO_CHATS = REPO / "data" / "demo_chats.jsonl"

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


def _chat_token_batches(tok, chats: Path, max_len: int = 256) -> list[list[int]]:
    seqs = []
    for raw in chats.read_text().splitlines():
        rec = json.loads(raw)
        if "messages" in rec:
            msgs = rec["messages"]
        else:
            role = {"human": "user", "gpt": "assistant", "system": "system"}
            msgs = [{"role": role[m["from"]], "content": m["value"]} for m in rec["conversations"]]
        text = tok.apply_chat_template(msgs, tokenize=False)
        seqs.append(tok.encode(text, add_special_tokens=False)[:max_len])
    return seqs


def train_on_chats(model, tok, steps: int, seed: int = 0, chats: Path = DEMO_CHATS,
                   batch_size: int = 16, lr: float = 3e-3) -> list[float]:
    """Next-token training on whole chats; returns the loss curve (one value per step)."""
    import torch
    from tqdm import tqdm

    seqs = _chat_token_batches(tok, chats)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then linear decay to 10%
        opt, lambda s: (s + 1) / warmup if s < warmup else max(0.1, 1 - (s - warmup) / max(1, steps - warmup)))
    pad = tok.pad_token_id
    losses = []
    model.train()
    for _ in tqdm(range(steps), desc="train tiny target", unit="step"):
        idx = torch.randint(len(seqs), (batch_size,), generator=g).tolist()
        width = max(len(seqs[i]) for i in idx)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        labels = ids.masked_fill(ids == pad, -100)
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
    model.eval()
    return losses


def save_target(kind: str, model, tok, out: Path, recipe: dict) -> None:
    """Write the folder atomically: a half-built target is never mistaken for one."""
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        tok.save_pretrained(tmp)
        if kind == "kimi_k25":
            text = model.config.to_dict()
            cfg = {
                "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": text, "vocab_size": text["vocab_size"],
                "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
            }
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
            state = {f"language_model.{k}": v.contiguous() for k, v in model.state_dict().items()}
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "TINY_TARGET.json").write_text(json.dumps({"kind": kind, "recipe": recipe}) + "\n")


def build_tiny_target(kind: str, out: Path | str, seed: int = 0, force: bool = False,
                      train_steps: int = 0) -> Path:
    if kind not in KINDS:
        raise ValueError(f"unknown tiny target kind {kind!r}; choose one of {KINDS}")
    out = Path(out)
    marker = out / "TINY_TARGET.json"
    recipe = {"kind": kind, "seed": seed, "train_steps": train_steps}
    if marker.is_file() and not force and json.loads(marker.read_text()).get("recipe") == recipe:
        log.info("tiny %s target already at %s", kind, out)
        return out
    tok = build_tokenizer()
    model = build_model(kind, tok, seed)
    losses = train_on_chats(model, tok, train_steps, seed) if train_steps else []
    save_target(kind, model, tok, out, recipe={**recipe, "final_loss": losses[-1] if losses else None})
    log.info("built tiny %s target at %s (vocab %d, %d layers%s)", kind, out, model.config.vocab_size,
             model.config.num_hidden_layers,
             f", trained {train_steps} steps: loss {losses[0]:.2f} -> {losses[-1]:.2f}" if losses else ", untrained")
    return out


def main(argv: list[str] | None = None) -> None:
    from .logs import setup_logging

    p = argparse.ArgumentParser(description="Build a tiny target model folder for the demo and tests.")
    p.add_argument("--kind", choices=KINDS, default="llama")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    p.add_argument("--train-steps", type=int, default=0,
                   help="train the random model on the shipped chats for this many steps (the demo uses 300)")
    a = p.parse_args(argv)
    setup_logging()
    build_tiny_target(a.kind, a.out, a.seed, a.force, a.train_steps)


if __name__ == "__main__":
    main()
