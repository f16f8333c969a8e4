"""The exported drafter's model card (README.md): the parts stages 05 and 06 share.

Stage 05 writes the card into the drafter folder (eagle3/stages/s05_export/card.py); stage 06,
when it measures that folder, writes its table between this module's markers and nowhere
else, so a user's edits outside them survive every rerun. The card is the Hub's format: a
YAML front matter (`base_model`, `library_name`, `pipeline_tag`, `tags`, `license` only when
the target's own card states one; docs/STAGES.md "The model card"), then Markdown.

Also here, because a card and the docs must show the same thing: the serve commands of
both engines (as README "Serve the drafter" writes them); the minimum engine versions beside
them are eagle3/serving/engine_rules.py `minimum_version`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from eagle3.artifacts.atomic import atomic_path

CARD_NAME = "README.md"  # the file the Hub renders as a repository's card
# Where stage 06's table lives in the card; only the text between them is ever replaced.
EVALUATE_BEGIN = "<!-- eagle3:evaluate:begin -->"
EVALUATE_END = "<!-- eagle3:evaluate:end -->"
# How published EAGLE-3 drafters label themselves on the Hub (docs/STAGES.md cites one).
LIBRARY_NAME = "transformers"
PIPELINE_TAG = "text-generation"
TAGS = ("eagle3", "speculative-decoding", "draft-model", "vllm", "sglang")


def _yaml_scalar(v) -> str:
    # JSON strings are valid YAML scalars, and quoting keeps ids such as "1.0" or "yes" strings.
    return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def front_matter(base_model: str | None, license: str | None, extra_tags: tuple[str, ...] = ()) -> str:
    """The Hub's YAML block: base model, library, pipeline tag, tags, and the license only
    when one was read from the target's card (None: the key is left out; so is a base model
    that is not a Hub id, which the Hub would refuse)."""
    lines = ["---"] + ([f"base_model: {_yaml_scalar(base_model)}"] if base_model else []) + [
        f"library_name: {LIBRARY_NAME}", f"pipeline_tag: {PIPELINE_TAG}"]
    if license:
        lines.append(f"license: {_yaml_scalar(license)}")
    lines.append("tags:")
    lines += [f"- {_yaml_scalar(t)}" for t in dict.fromkeys((*TAGS, *extra_tags))]
    return "\n".join(lines + ["---", ""])


def hub_id(target: str, base_model: str | None) -> str | None:
    """The Hub id a card names as `base_model`: `base_model` when given, else the target when it
    is not a local folder (an `owner/name` id); None for a local target without one."""
    if base_model:
        return base_model
    if Path(target).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", target):
        return None
    return target


def target_license(target: str) -> str | None:
    """The `license` of the target's own card: its folder's README.md, or the Hub's copy in the
    local cache for a hub id (no network). None when no card or no license is found."""
    card = Path(target) / CARD_NAME
    if not card.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(target, CARD_NAME)
        except Exception:  # not a valid repo id, no cache: no card to read
            cached = None
        if not isinstance(cached, str):
            return None
        card = Path(cached)
    m = re.match(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", card.read_text(errors="replace"), re.S)
    if not m:
        return None
    import yaml

    try:
        meta = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        return None
    lic = meta.get("license") if isinstance(meta, dict) else None
    return str(lic) if lic else None


def serve_commands(target: str, drafter: str, k: int, tensor_parallel: int = 1,
                   trust_remote_code: bool = False) -> dict[str, str]:
    """The SGLang and vLLM commands that serve `target` with this drafter and K speculative tokens
    (chain drafting, top-k 1: what stage 06 measures), keyed "sglang" / "vllm"."""
    sg_tp = f" --tp {tensor_parallel}" if tensor_parallel > 1 else ""
    vl_tp = f" --tensor-parallel-size {tensor_parallel}" if tensor_parallel > 1 else ""
    trust = " --trust-remote-code" if trust_remote_code else ""
    spec = json.dumps({"method": "eagle3", "model": drafter, "num_speculative_tokens": k})
    return {
        "sglang": (f"python -m sglang.launch_server --model-path {target}{sg_tp}{trust} \\\n"
                   f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {drafter} \\\n"
                   f"    --speculative-num-steps {k} --speculative-eagle-topk 1 "
                   f"--speculative-num-draft-tokens {k + 1}"),
        "vllm": f"vllm serve {target}{vl_tp}{trust} \\\n    --speculative-config '{spec}'",
    }


def evaluate_section(body: str) -> str:
    """Stage 06's table wrapped in its markers."""
    return f"{EVALUATE_BEGIN}\n{body.rstrip()}\n{EVALUATE_END}"


def replace_evaluate_section(card: str, body: str) -> str:
    """`card` with the text between the markers replaced by `body` (the markers kept); a card
    without them (written by hand, or by an older stage 05) gets the section at its end.
    Nothing outside the markers changes."""
    begin, end = card.find(EVALUATE_BEGIN), card.find(EVALUATE_END)
    if begin != -1 and end > begin:
        return card[:begin] + evaluate_section(body) + card[end + len(EVALUATE_END):]
    return card.rstrip("\n") + "\n\n" + evaluate_section(body) + "\n"


def write_evaluate_section(drafter_dir: Path, body: str) -> Path | None:
    """Put stage 06's table between the markers of the card in `drafter_dir` (atomically).
    None, and nothing written, when the folder has no card or its card lacks the markers
    (a drafter published by someone else: its card is theirs)."""
    path = Path(drafter_dir) / CARD_NAME
    if not path.is_file():
        return None
    card = path.read_text()
    if EVALUATE_BEGIN not in card or EVALUATE_END not in card:
        return None
    text = replace_evaluate_section(card, body)
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path
