"""Stage 01: chats -> token ids, assistant-only loss mask, token frequencies.

    python 01_prepare_dataset.py --config configs/tiny-llama.yaml [--max-length 2048] [--strict]

Writes WORK/01_dataset/ (see eagle3/stages/s01_prepare/run.py).
"""
from eagle3.core.cli import run_stage
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s01_prepare.run import prepare_dataset

if __name__ == "__main__":
    run_stage(PrepareConfig, "prepare", prepare_dataset, __doc__, sections=STAGE_CONFIGS)
