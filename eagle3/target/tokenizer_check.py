"""Is the loaded tokenizer the one the target ships? Checked before stages 00, 01 and 06 work.

Reads the target's `tokenizer_config.json` (its `auto_map` and `added_tokens_decoder`;
`tokenizer.json`'s `added_tokens` when the config lists none) and `generation_config.json`
(its `eos_token_id`), and compares them with the tokenizer transformers built:

1. its class is the one `auto_map["AutoTokenizer"]` names, when the target has one and
   trust_remote_code is on;
2. every added token the chat template writes encodes to exactly one id, the one the
   target's files give it;
3. the end-of-turn token the loss mask ends each answer with (the first token of the
   template's assistant suffix, when it is a special token) is among
   `generation_config.json`'s eos ids, which is where a server stops an answer.

Why: transformers 5.4.0 and 5.5.0-5.5.3 ignored Kimi-K2.5's `auto_map` and built a
generic fast tokenizer that packs the sparse special-token ids densely: every special
token after 163588 gets an id 1-3 lower and `</think>` (163607) decodes to '' (transformers
issue #45356, fixed by PR #45359 in 5.5.4; docs/KIMI_K25.md, "Tokenizer"). Nothing fails:
the data, the mask and the drafter come out wrong. A mismatch here is a refusal naming the
token, both ids and the installed transformers version.

No model is loaded; the files are read from the target folder (or the hub cache).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle3.core.errors import PipelineError
from eagle3.target.info import chat_template_text

log = logging.getLogger(__name__)

# transformers releases that ignore Kimi-K2.5's auto_map (docs/KIMI_K25.md, "Tokenizer").
BAD_TRANSFORMERS = ("5.4.0", "5.5.0", "5.5.1", "5.5.2", "5.5.3")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _version_note() -> str:
    v = transformers_version()
    release = v.split("+")[0]
    if release in BAD_TRANSFORMERS:
        return (f"transformers {v} is one of the releases that ignore a tokenizer's auto_map "
                f"({', '.join(BAD_TRANSFORMERS)}; transformers issue #45356): install 5.5.4 or later "
                f"(README, \"Engine versions\")")
    return f"transformers {v}"


def read_target_file(model: str | Path, name: str) -> dict | None:
    """`name` (a JSON file) of the target folder or hub id; None when it has none."""
    path = Path(model)
    if path.is_dir():
        f = path / name
        return json.loads(f.read_text()) if f.is_file() else None
    try:  # a hub id: load_tokenizer has just fetched these files into the cache
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(str(model), name)).read_text())
    except Exception:  # noqa: BLE001 - no such file, or no network: nothing to compare with
        return None


def expected_added_tokens(model: str | Path) -> tuple[dict[str, int], str]:
    """content -> id of the target's added tokens, and the file they were read from."""
    cfg = read_target_file(model, "tokenizer_config.json") or {}
    decoder = cfg.get("added_tokens_decoder") or {}
    if decoder:
        return {t["content"]: int(i) for i, t in decoder.items()}, "tokenizer_config.json"
    spec = read_target_file(model, "tokenizer.json") or {}
    return {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []}, "tokenizer.json"


def template_tokens(template: str, added: dict[str, int]) -> dict[str, int]:
    """The added tokens whose text the chat template contains."""
    return {c: i for c, i in added.items() if c and c in template}


def auto_map_classes(model: str | Path) -> list[str]:
    """Class names `auto_map["AutoTokenizer"]` of tokenizer_config.json names ([] if none)."""
    cfg = read_target_file(model, "tokenizer_config.json") or {}
    ref = (cfg.get("auto_map") or {}).get("AutoTokenizer")
    refs = ref if isinstance(ref, (list, tuple)) else [ref]
    return [r.split("--")[-1].split(".")[-1] for r in refs if r]


def generation_eos_ids(model: str | Path) -> list[int]:
    cfg = read_target_file(model, "generation_config.json") or {}
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return [int(x) for x in (eos if isinstance(eos, list) else [eos])]


def special_ids(tok) -> set[int]:
    """The tokenizer's special ids: the named ones and every added token marked special
    (Kimi's `<|im_end|>` is only the latter)."""
    return set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}


def check_tokenizer(model: str | Path, tok, *, trust_remote_code: bool, suffix: list[int]) -> None:
    """Refuse a tokenizer that disagrees with the target's files (module doc).

    `suffix`: the template's assistant suffix (eagle3/target/loss_mask.py `assistant_suffix`),
    whose first token the mask keeps as the answer's end of turn.
    """
    classes = auto_map_classes(model)
    if classes and trust_remote_code and type(tok).__name__ not in classes:
        raise PipelineError(
            f"{model}/tokenizer_config.json maps AutoTokenizer to {classes}, but {_version_note()} built a "
            f"{type(tok).__name__}: the target's own tokenizer class was ignored, and its special-token ids may be "
            f"shifted. Use a transformers release that honours auto_map.")
    added, source = expected_added_tokens(model)
    for content, want in sorted(template_tokens(chat_template_text(tok), added).items(), key=lambda x: x[1]):
        got = tok.encode(content, add_special_tokens=False)
        if got != [want]:
            raise PipelineError(
                f"{model}: the chat template's token {content!r} is id {want} in {source}, but the loaded "
                f"{type(tok).__name__} encodes it as {got} ({_version_note()}): every sample would carry the wrong "
                f"ids. Load the target's own tokenizer (--trust-remote-code when its tokenizer_config.json has an "
                f"auto_map) with a transformers release that gives the files' ids.")
    end = suffix[0] if suffix and suffix[0] in special_ids(tok) else None
    eos = generation_eos_ids(model)
    if end is not None and eos and end not in eos:
        name = tok.convert_ids_to_tokens(end)
        raise PipelineError(
            f"{model}: the loss mask ends each answer on {name!r} (id {end}, the chat template's end of turn), but "
            f"generation_config.json's eos_token_id is {eos if len(eos) > 1 else eos[0]} "
            f"({[tok.convert_ids_to_tokens(i) for i in eos]}; {_version_note()}): the drafter would learn an "
            f"end of turn the server does not stop on. Check that the tokenizer and generation_config.json belong "
            f"to the same target.")
    log.debug("tokenizer of %s checked against %s and generation_config.json", model, source)
