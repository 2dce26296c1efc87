"""`SamplingParams`, the engine library's name for the one sampling struct every door builds.

It lives in the client package (`nanovllm_client.sampling`), torch-free, so the ZeroMQ clients,
the HTTP front, the tokenizer stage and the engine validate a request with the same code and the
same limits; this module re-exports it for `from nanovllm import SamplingParams`.
"""
from __future__ import annotations

from nanovllm_client.sampling import *  # noqa: F401,F403 (the struct, its error and its limits)
from nanovllm_client.sampling import SamplingError, SamplingParams  # noqa: F401 (named for readers and linters)
