"""Stage 03: token frequencies -> the draft vocabulary (`d2t` / `t2d`).

    python 03_build_vocab_mapping.py --config configs/tiny-llama.yaml [--draft-vocab-size 32000]

Reads WORK/01_dataset/, writes WORK/03_vocab/ (see eagle3/stages/s03_vocab/run.py).
"""
from eagle3.core.cli import run_stage
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.stages.s03_vocab.run import build_vocab_mapping

if __name__ == "__main__":
    run_stage(VocabConfig, "vocab", build_vocab_mapping, __doc__, sections=STAGE_CONFIGS)
