"""Real chat templates, written here as text, and tokenizers built around them.

Each template reproduces the shape of a family's own template (special tokens,
headers, end-of-turn, what follows it, default system prompts), so the loss-mask
tests exercise the cases that break regex-based maskers.
"""
from __future__ import annotations

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
KIMI_K2 = dict(
    special=["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"],
    bos=None, eot="<|im_end|>", after_eot="",
    template=(
        "{% if messages[0]['role'] != 'system' %}"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "{% endif %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}<|im_system|>system<|im_middle|>"
        "{% elif message['role'] == 'user' %}<|im_user|>user<|im_middle|>"
        "{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
        "{{ message['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"),
)

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
