"""Client tests run from a checkout even when the client distribution is not installed."""
import os
import sys

try:
    import nanovllm_client  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "client"))
