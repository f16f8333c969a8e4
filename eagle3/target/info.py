"""What the pipeline needs to know about a target model, read without loading it.

Reads the target's `config.json` (sizes under `text_config` for multimodal targets
such as Kimi-K2.5), its tokenizer, and fingerprints of both. Also owns the aux
layer convention (docs/CONVENTIONS.md §1): "layer k" is the residual stream after
k decoder layers, default ids `[2, N//2, N-3]`.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.errors import PipelineError
from eagle3.core.logs import quiet_tokenizers

log = logging.getLogger(__name__)

# Keys under which multimodal configs nest the language model's config.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


@dataclass(frozen=True)
class TargetInfo:
    source: str  # local dir or hub id
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_attention_heads: int
    text_config_key: str | None  # "text_config" when sizes were nested
    text_config: dict  # the (text) config dict the sizes came from

    def default_aux_layers(self) -> list[int]:
        return default_aux_layers(self.num_layers)


def default_aux_layers(num_layers: int) -> list[int]:
    """`[2, N//2, N-3]`: `[2, 30, 58]` for the 61 layers of Kimi-K2.5."""
    return [2, num_layers // 2, num_layers - 3]


def validate_aux_layers(ids: list[int], num_layers: int, source: str = "aux_layers",
                        fix: str = "use ids") -> list[int]:
    """Distinct, ascending, 1 <= k < N (convention 1); raise naming the fix (`fix`: its
    opening, for a caller whose ids come from a file rather than a flag)."""
    ids = [int(i) for i in ids]
    fix = (f"{fix} in [1, {num_layers - 1}] for this {num_layers}-layer target, "
           f"e.g. the default {default_aux_layers(num_layers)}")
    if not ids:
        raise PipelineError(f"{source} is empty; {fix}.")
    neg = [i for i in ids if i < 0]
    if neg:
        raise PipelineError(
            f"{source} = {ids} has negative id(s) {neg}; negative (Python-style) ids are ambiguous "
            f"between engines and not accepted: {fix}.")
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        raise PipelineError(f"{source} = {ids}: id(s) {bad} out of range; {fix}.")
    if ids != sorted(set(ids)):
        raise PipelineError(f"{source} = {ids} must be distinct and ascending; {fix}.")
    return ids


def _read_config_dict(model: str, trust_remote_code: bool) -> dict:
    path = Path(model)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise PipelineError(f"{path} has no config.json; --target-model must be a model folder or hub id.")
        return json.loads(cfg_file.read_text())
    if path.suffix == ".json" and path.is_file():
        return json.loads(path.read_text())
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as e:  # noqa: BLE001 - any hub failure means the same fix
        raise PipelineError(
            f"cannot read config.json of target {model!r} ({type(e).__name__}: {e}); pass a local "
            f"model folder with --target-model, or check the hub id and network.") from e


def text_config_of(cfg: dict) -> tuple[dict, str | None]:
    for key in TEXT_CONFIG_KEYS:
        sub = cfg.get(key)
        if isinstance(sub, dict) and "num_hidden_layers" in sub:
            return sub, key
    return cfg, None


def read_target_info(model: str | Path, trust_remote_code: bool = False) -> TargetInfo:
    cfg = _read_config_dict(str(model), trust_remote_code)
    text, key = text_config_of(cfg)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        where = f"{model}/config.json" + (f" [{key}]" if key else "")
        raise PipelineError(f"{where} lacks {missing}; is this a causal LM config?")
    archs = cfg.get("architectures") or text.get("architectures") or ["?"]
    return TargetInfo(
        source=str(model),
        architecture=archs[0],
        model_type=cfg.get("model_type", text.get("model_type", "?")),
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 0)),
        num_attention_heads=int(text.get("num_attention_heads", 0)),
        text_config_key=key,
        text_config=text,
    )


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer


    quiet_tokenizers()
    try:
        tok = AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise PipelineError(
                f"the tokenizer of {model} needs custom code; if you trust it, pass "
                f"--trust-remote-code (or `trust_remote_code: true` in the YAML).") from e
        raise
    if tok.chat_template is None:
        raise PipelineError(
            f"the tokenizer of {model} has no chat template; stage 01 renders conversations with "
            f"the target's own template, so use the chat (instruct) model's tokenizer.")
    return tok


def tokenizer_fingerprint(tok) -> str:
    """sha256 over the vocabulary, special tokens and chat template.

    Computed from the loaded tokenizer, not its files, so the same tokenizer saved
    in another format (tokenizer.json vs tiktoken model) gets the same fingerprint.
    """
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tok.all_special_tokens))).encode())
    h.update(json.dumps(chat_template_text(tok)).encode())
    return h.hexdigest()


def chat_template_text(tok) -> str:
    t = tok.chat_template
    return t if isinstance(t, str) else json.dumps(t, sort_keys=True)


def chat_template_fingerprint(tok) -> str:
    return hashlib.sha256(chat_template_text(tok).encode()).hexdigest()


SAMPLE_BYTES = 1 << 20


def weights_fingerprint(model: str | Path) -> str:
    """A cheap fingerprint of a local target's safetensors weights.

    Hashes each file's name, size, and its first and last MiB (the header with every
    tensor's name, shape and offset, and the bytes of the first and last tensors), so
    a retrained target with the same config is told apart without reading hundreds
    of GB. A hub id is identified by its name only.
    """
    path = Path(model)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return f"unhashed:{model}"
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                fh.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                h.update(fh.read())
    return h.hexdigest()
