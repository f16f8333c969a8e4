"""Stage 04: train the EAGLE-3 drafter (from scratch, or fine-tuned with --init-from).

    python 04_train_drafter.py --config configs/tiny-llama.yaml
    torchrun --nproc-per-node 8 04_train_drafter.py --config configs/kimi-k2.5.yaml
    python 04_train_drafter.py --config ... --init-from AQ-MedAI-drafter/ [--vocab-mode remap]

Reads WORK/02_hidden_states/ and WORK/03_vocab/, writes WORK/04_train/
(see eagle3/stages/s04_train/run.py). A killed run resumes from its last checkpoint.
"""
from eagle3.core.cli import run_stage
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter

if __name__ == "__main__":
    run_stage(TrainConfig, "train", train_drafter, __doc__, sections=STAGE_CONFIGS)
