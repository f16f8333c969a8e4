"""Stage 01: chats -> token ids, assistant-only loss mask, token frequencies.

    python 01_prepare_dataset.py --config configs/tiny-llama.yaml [--max-length 2048] [--strict]

Writes WORK/01_dataset/ (see eagle3/prepare.py).
"""
from eagle3.cli import run_stage
from eagle3.prepare import PrepareConfig, prepare_dataset

if __name__ == "__main__":
    run_stage(PrepareConfig, "prepare", prepare_dataset, __doc__)
