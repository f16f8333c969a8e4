"""Stage 02: hidden-state extraction (target forward passes -> the hidden-state store).

`extract_hidden_states(ExtractConfig(...))` is the stage; backends: `hf_backend`
(transformers) and `vllm_backend` (+ `vllm_connector`, the only modules importing
vllm, loaded lazily). The store format and its reader live in eagle3/store.py.
"""
from .config import ExtractConfig
from .run import extract_hidden_states

__all__ = ["ExtractConfig", "extract_hidden_states"]
