"""EAGLE-3 drafter training pipeline: the library behind the numbered scripts."""
