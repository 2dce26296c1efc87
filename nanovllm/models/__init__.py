"""Model definitions, checkpoint loading and tokenizer loading."""
