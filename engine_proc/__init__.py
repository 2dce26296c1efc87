"""Engine stage of the nanovllm service: `python -m engine_proc --help`."""
