"""The target model's files, read without loading the model, and the chats rendered for it.

    info.py             TargetInfo: its config.json (sizes, aux layer convention), fingerprints
    tokenizer_check.py  the tokenizer checked against the target's own files
    head.py             its final norm, lm_head and input embedding, read from the checkpoint
    chats.py            chat records read and normalised to role/content messages, duplicates marked
    json_items.py       a .json file's records read one at a time (chats.py's reader)
    loss_mask.py        a chat rendered with the target's template, with its assistant-only loss mask

Imports: eagle3.core only (tests/unit/test_layout.py).
"""
