"""Stage 01: chats -> token ids, assistant-only loss mask, token frequencies.

    python 01_prepare_dataset.py --config configs/tiny-llama.yaml [--max-length 2048] [--strict]

Writes WORK/01_dataset/ (see eagle3/stages/s01_prepare/run.py).
"""
from eagle3.core.cli import stage_main

if __name__ == "__main__":
    stage_main("prepare", __doc__)
