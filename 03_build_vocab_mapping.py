"""Stage 03: token frequencies -> the draft vocabulary (`d2t` / `t2d`).

    python 03_build_vocab_mapping.py --config configs/tiny-llama.yaml [--draft-vocab-size 32000]

Reads WORK/01_dataset/, writes WORK/03_vocab/ (see eagle3/stages/s03_vocab/run.py).
"""
from eagle3.core.cli import stage_main

if __name__ == "__main__":
    stage_main("vocab", __doc__)
