"""The target's files (config, tokenizer, embedding and head) and the chat rendering with its loss mask."""
