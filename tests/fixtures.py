"""What the tests share: the pipeline run on a few chats, chat templates, tiny settings.

- `run_stages`: stages `first`..`upto` in one work dir on a target, on the first N demo
  chats (or a chat file), each stage's config from this module's tiny defaults or from a
  YAML file, with per-stage overrides. tests/conftest.py builds the common runs once per
  session through it (`stage_runs`, `stages_123`); `copy_stages` gives a test that writes
  its own copy.
- Chat templates of four families and two reasoning ones (Qwen3's and DeepSeek-R1's history
  rules), written here as text, and tokenizers built around them (`make_tokenizer`); Kimi-K2.5's
  template and special-token ids come from eagle3/demo/kimi_k25_tokenizer.py
  (`kimi_k25_tokenizer`, `save_kimi_k25_target`).
- `kill_after_entries`: a stage-02 command killed -9 part way.
- `torchrun`: a command under `torchrun --nproc-per-node N`, its workers killed on a timeout.
- `draft_labels`: `ttt_loss`'s labels from a small target's full logits.

Tests in tests/unit, tests/stages and tests/e2e import this as a top-level module
(tests/conftest.py puts tests/ on sys.path); no test module imports another.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import build_config
from eagle3.core.stages import STAGE, STAGES
from eagle3.stages.configs import STAGE_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
DEMO_CHATS = ROOT / "data" / "demo_chats.jsonl"

# -- the pipeline on a few chats -----------------------------------------------------------------

# Stage 04 at a size that trains in seconds on CPU (tests pass other sizes as overrides).
TINY_TRAIN = dict(max_steps=4, batch_tokens=1024, max_seq_len=256, log_every=2, eval_every=1000, save_every=1000,
                  ttt_steps=2, warmup_steps=1)

# Each stage's settings when no YAML file is given: the HF backend in float32, 32 samples per
# store file, a 128-token draft vocabulary.
TINY = {
    "prepare": dict(max_length=256, eval_fraction=0.15, num_workers=1),
    "extract": dict(backend="hf", samples_per_file=32, dtype="float32"),
    "vocab": dict(draft_vocab_size=128),
    "train": TINY_TRAIN,
}


def first_chats(path: Path, n: int) -> Path:
    """The first `n` demo chats, written to `path`."""
    path.write_text("\n".join(DEMO_CHATS.read_text().splitlines()[:n]) + "\n")
    return path


def run_stages(work: Path, target: Path, *, upto: str = "vocab", first: str = "prepare",
               chats: int | Path | None = 60, config: Path | None = None, **overrides: dict) -> Path:
    """Stages `first`..`upto` (registry keys: "prepare" is 01) in `work` on `target`.

    chats: stage 01's `data` when stage 01 runs: an int takes the first N demo chats (written
    to work/chats.jsonl), a path is the chat file itself, None leaves `data` to the config.
    config: a YAML file whose sections replace `TINY` (as `--config` does for the scripts).
    overrides: per stage key, settings over either, e.g. `vocab=dict(draft_vocab_size=64)`.
    """
    unknown = set(overrides) - set(STAGE)
    assert not unknown, f"run_stages: no stage {sorted(unknown)}; stage keys are {list(STAGE)}"
    keys = [s.key for s in STAGES]
    work.mkdir(parents=True, exist_ok=True)
    for key in keys[keys.index(first): keys.index(upto) + 1]:
        settings = {"work_dir": work, "target_model": str(target), **({} if config else TINY.get(key, {}))}
        if key == "prepare" and chats is not None:
            data = first_chats(work / "chats.jsonl", chats) if isinstance(chats, int) else chats
            settings["data"] = [str(data)]
        settings.update(overrides.get(key, {}))
        stage_entries()[key](build_config(STAGE_CONFIGS[key], key, config, settings, sections=STAGE_CONFIGS))
    return work


def stage_entries() -> dict:
    """Each stage's entry function by registry key, as its numbered script imports it. Imported
    here, when a test runs stages, not when the test session starts (stage 04's pulls in torch)."""
    from eagle3.stages.s00_generate.run import generate_responses
    from eagle3.stages.s01_prepare.run import prepare_dataset
    from eagle3.stages.s02_extract.run import extract_hidden_states
    from eagle3.stages.s03_vocab.run import build_vocab_mapping
    from eagle3.stages.s04_train.run import train_drafter
    from eagle3.stages.s05_export.run import export_drafter
    from eagle3.stages.s06_evaluate.run import evaluate_drafter

    return {"generate": generate_responses, "prepare": prepare_dataset, "extract": extract_hidden_states,
            "vocab": build_vocab_mapping, "train": train_drafter, "export": export_drafter,
            "evaluate": evaluate_drafter}


def copy_stages(base: Path, dest: Path, stages=("prepare", "extract", "vocab")) -> Path:
    """A private copy of some of base's stages (by default 01-03) for a test that writes."""
    for key in stages:
        shutil.copytree(WorkDir(base).stage_dir(key), WorkDir(dest).stage_dir(key))
    return dest


def draft_labels(draft_ids, logits):
    """`ttt_loss`'s labels from full-vocab target logits [B, T, V_t], as stage 04 gets them from
    the store: the softmax over the draft rows (in at least fp32) and the full-vocab argmax.
    The tests' small targets give logits; stage 04 gives `target_draft_distribution` the
    normed hidden state and the stored argmax."""
    import torch

    acc = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits[..., draft_ids].to(acc), dim=-1)  # [B, T, V_t] -> [B, T, V_d]
    return probs, logits.argmax(dim=-1)  # [B, T, V_t] -> [B, T]


def kill_after_entries(cmd: list[str], store_dir: Path, entries: int = 2, timeout_s: float = 120) -> None:
    """Run a stage-02 command and kill -9 it once `entries` store files are complete (their
    index entries written), so a rerun has some files to keep and some to redo."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while len(list(store_dir.glob("*-0*.json"))) < entries:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def torchrun(nproc: int, args: list, timeout_s: float, logs: Path) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC ARGS` (gloo, one thread per rank), its output in files under
    `logs`. On a timeout its workers are killed too (torchrun starts each in a session of its
    own, so killing torchrun alone would leave them waiting in a collective), then it fails."""
    import os
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           *map(str, args)]
    logs.mkdir(parents=True)
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            workers = [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
                       if _parent_pid(stat) == proc.pid]
            proc.kill()
            proc.wait()
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise AssertionError(f"{nproc} processes did not finish in {timeout_s} s: "
                                 f"{(logs / 'stderr').read_text()[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, (logs / "stdout").read_text(),
                                       (logs / "stderr").read_text())


def _parent_pid(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# -- chat records ------------------------------------------------------------------------------
# One good conversation (ASCII and non-ASCII), as the JSONL lines of a chat file, and a bad one.
GOOD = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "The capital of France is Paris."}]}
GOOD_UNICODE = {"messages": [{"role": "user", "content": "Grüße aus Köln ☕"},
                             {"role": "assistant", "content": "Danke schön 😊"}]}


def good_line(rec=GOOD) -> bytes:
    return json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n"


def numbered(rec: dict, i: int) -> dict:
    """A copy of a chat record (OpenAI or ShareGPT) whose last turn ends with ` (i)`: records of
    one shape that are not duplicates of each other (stages drop exact duplicates)."""
    key, text = ("messages", "content") if "messages" in rec else ("conversations", "value")
    turns = [dict(t) for t in rec[key]]
    turns[-1][text] += f" ({i})"
    return {**rec, key: turns}


def bad_utf8_line() -> bytes:
    # A Latin-1 encoded line, as found in real dumps: 0xe9 alone is not UTF-8.
    return good_line({"messages": [{"role": "user", "content": "caf\u00e9?"},
                                   {"role": "assistant", "content": "oui"}]}).replace(b"\xc3\xa9", b"\xe9")


# -- chat templates -----------------------------------------------------------------------------
# Real chat templates, written here as text: each reproduces the shape of a family's own
# template (special tokens, headers, end-of-turn, what follows it, default system prompts), so
# the loss-mask tests exercise the cases that break regex-based maskers.

LLAMA3 = dict(
    special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    bos="<|begin_of_text|>", eot="<|eot_id|>", after_eot="",
    template=(
        "{{ bos_token }}{% for message in messages %}"
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
)

# Qwen2.5 style: a default system prompt when none is given, and a newline after <|im_end|>.
CHATML = dict(
    special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    bos=None, eot="<|im_end|>", after_eot="\n",
    template=(
        "{% if messages[0]['role'] == 'system' %}"
        "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{% for message in messages %}{% if not (loop.first and message['role'] == 'system') %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
)

# DeepSeek-V3 style: system text bare after BOS, no newlines, <｜end▁of▁sentence｜> ends assistant turns.
DEEPSEEK_V3 = dict(
    special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
    bos="<｜begin▁of▁sentence｜>", eot="<｜end▁of▁sentence｜>", after_eot="",
    template=(
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ message['content'] }}{% endif %}{% endfor %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
        "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"),
)

# Kimi-K2 style: role names inside the header, <|im_middle|> separator, a default system prompt.
_KIMI_TURNS = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|im_system|>system<|im_middle|>"
    "{% elif message['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    "{{ message['content'] }}<|im_end|>{% endfor %}")
KIMI_K2 = dict(
    special=["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"],
    bos=None, eot="<|im_end|>", after_eot="",
    template=_KIMI_TURNS + "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
)

# Qwen3's reasoning rules (its chat_template.jinja, docs/KIMI_K25.md "Chat template and turns"):
# an assistant turn after the last user turn shows `<think>\n` + reasoning + `\n</think>\n\n`
# + answer (the final message always does), every earlier one only its answer; the reasoning
# comes from `reasoning_content` or the text before `</think>`. The generation prompt is the
# bare header; the model opens `<think>` itself (`enable_thinking=False` prefills an empty pair).
# (No tool handling: the pipeline's chats have none.)
QWEN3_THINKING = dict(
    CHATML, special=CHATML["special"] + ["<think>", "</think>"],
    template=(
        "{%- set ns = namespace(last_query=messages|length - 1) -%}"
        "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' -%}"
        "{%- set content = m['content'] -%}{%- set reasoning = '' -%}"
        "{%- if m.get('reasoning_content') is string -%}{%- set reasoning = m['reasoning_content'] -%}"
        "{%- elif '</think>' in content -%}"
        "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}"
        "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
        "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
        "{{ '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
        "{%- else -%}{{ '<|im_start|>assistant\n' + content }}{%- endif -%}{{ '<|im_end|>\n' }}"
        "{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}"
        "{%- endif -%}{%- endif -%}"),
)

# DeepSeek-R1's reasoning rules (its chat_template.jinja): every assistant turn, the final one
# too, shows only the text after `</think>`; the generation prompt opens `<think>\n`. (The
# DeepSeek-V3 shape above, with those two rules; no tool handling.)
DEEPSEEK_R1 = dict(
    DEEPSEEK_V3, special=DEEPSEEK_V3["special"] + ["<think>", "</think>"],
    template=DEEPSEEK_V3["template"].replace(
        "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}",
        "{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}").replace(
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}",
        "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}"),
)
assert DEEPSEEK_R1["template"].count("</think>") == 1 and "<think>\n" in DEEPSEEK_R1["template"]


@functools.lru_cache(maxsize=1)
def kimi_k25_tokenizer():
    """The Kimi-K2.5 stand-in (eagle3/demo/kimi_k25_tokenizer.py), built once per session
    (a few seconds); read-only."""
    from eagle3.demo.kimi_k25_tokenizer import build_tokenizer

    return build_tokenizer()


def save_kimi_k25_target(path: Path) -> Path:
    """    A folder stages 00 and 01 load as a Kimi-K2.5 target: the stand-in tokenizer (with the
    real tokenizer_config.json's `added_tokens_decoder`), a small config with the real
    vocabulary size and eos, and generation_config.json's end of turn (no weights: the tests
    script the target)."""
    from transformers import GenerationConfig, LlamaConfig

    from eagle3.demo.kimi_k25_tokenizer import END_OF_TURN_ID, EOS_ID, VOCAB_SIZE, write_added_tokens_decoder

    kimi_k25_tokenizer().save_pretrained(path)
    write_added_tokens_decoder(path)
    LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=1, num_key_value_heads=1, head_dim=64, eos_token_id=EOS_ID).save_pretrained(path)
    GenerationConfig(eos_token_id=END_OF_TURN_ID).save_pretrained(path)
    return path


TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2}

CORPUS = [
    "The capital of France is Paris.", "What is 2 plus 2? It is 4.", "Hello there, how are you?",
    "You are a helpful assistant.", "Count from one to five: one, two, three, four, five.",
    "Tell me a joke about cats.", "Why did the cat sit on the computer? To keep an eye on the mouse.",
]


def make_tokenizer(spec: dict):
    """A fast byte-level BPE tokenizer with the template's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=spec["bos"], eos_token=spec["eot"],
                                   chat_template=spec["template"])


def train_checkpoint(model: dict, drafter_config: dict, **fields):
    """A stage 04 checkpoint record (eagle3/artifacts/train_outputs.py) holding `model` and
    `drafter_config`, every other field a plausible value unless given in `fields`."""
    import torch

    from eagle3.artifacts.train_outputs import TrainCheckpoint

    base = dict(model=model, drafter_config=drafter_config, aux_layers=[2, 4, 5], optimizer={"state": {}},
                scheduler={}, step=2, epoch=0, batch_in_epoch=2,
                batch_geometry={"processes": 1, "grad_accum": 1, "batch_tokens": 1024, "max_seq_len": 256,
                                "packing": True},
                rounds_trained=0, rng=[{"torch": torch.get_rng_state()}],
                train_config={}, identity="x", best={"expected_accept_length": -1.0, "step": None}, eval={})
    return TrainCheckpoint(**{**base, **fields})


def record_fsyncs_and_renames(monkeypatch) -> list[tuple[str, str]]:
    """("fsync", path) and ("rename", destination), in the order they happen (the real calls run)."""
    seen: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        seen.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        seen.append(("rename", os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return seen


_HOLD_CLAIM = """import sys, time
from pathlib import Path
from eagle3.artifacts.claims import Claim
Claim.acquire(Path(sys.argv[1]), what=sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def claim_held_elsewhere(folder: Path, what: str):
    """A live process of this machine holding `folder`'s claim (eagle3/artifacts/claims.py), as a
    stage at work does; killed on the way out, so its claim is then a dead holder's."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_CLAIM, str(folder), what], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
