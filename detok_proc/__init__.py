"""Detokenizer stage of the nanovllm service: `python -m detok_proc --help`."""
