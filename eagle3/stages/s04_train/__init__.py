"""Stage 04: train the EAGLE-3 drafter (see eagle3/stages/s04_train/run.py)."""
