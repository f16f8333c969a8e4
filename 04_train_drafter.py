"""Stage 04: train the EAGLE-3 drafter (from scratch, or fine-tuned with --init-from).

    python 04_train_drafter.py --config configs/tiny-llama.yaml
    torchrun --nproc-per-node 8 04_train_drafter.py --config configs/kimi-k2.5.yaml
    python 04_train_drafter.py --config ... --init-from AQ-MedAI-drafter/ [--vocab-mode remap]

Reads WORK/02_hidden_states/ and WORK/03_vocab/, writes WORK/04_train/
(see eagle3/stages/s04_train/run.py). A killed run resumes from its last checkpoint.
"""
from eagle3.core.cli import stage_main

if __name__ == "__main__":
    stage_main("train", __doc__)
