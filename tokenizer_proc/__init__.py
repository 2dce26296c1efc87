"""Tokenizer stage of the nanovllm service: `python -m tokenizer_proc --help`."""
