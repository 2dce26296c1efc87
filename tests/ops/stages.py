"""What the unit tests know about the three stages and the HTTP front, taken from the code itself:
each stage's own argparse parser (its `main()` builds it; captured just before it parses), the
front's parser, and the NANOVLLM_* variables the stages, the front and the library read.
"""
from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from unittest import mock

from nanovllm.service.stage import env_name

REPO = Path(__file__).resolve().parents[2]
STAGE_OF_UNIT = {"nanovllm-tokenizer@.service": "tokenizer_proc", "nanovllm-engine@.service": "engine_proc",
                 "nanovllm-detok@.service": "detok_proc"}
FRONT_UNIT, FRONT_MODULE = "nanovllm-http@.service", "nanovllm_client.http"
_ENVIRON_READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](NANOVLLM_[A-Z0-9_]+)["']""")


class _Captured(Exception):
    pass


def stage_parser(module: str) -> argparse.ArgumentParser:
    """The parser `python -m <module>` builds, with defaults from the current environment."""
    main = importlib.import_module(f"{module}.__main__").main

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            main([])
        except _Captured as captured:
            return captured.args[0]
    raise AssertionError(f"{module}.main() returned without parsing its arguments")


def parser_variables(parser: argparse.ArgumentParser) -> set[str]:
    """NANOVLLM_<FLAG> for every --flag the parser has (stage.add_flag's naming)."""
    return {env_name(option) for action in parser._actions for option in action.option_strings
            if option.startswith("--") and not option.startswith("--no-") and option != "--help"}


def library_variables() -> set[str]:
    """NANOVLLM_* variables read straight from the environment by the library and the stages."""
    found: set[str] = set()
    for folder in ("nanovllm", "client/nanovllm_client", "tokenizer_proc", "engine_proc", "detok_proc"):
        for path in (REPO / folder).rglob("*.py"):
            found |= set(_ENVIRON_READ.findall(path.read_text(encoding="utf-8")))
    return found


def front_parser() -> argparse.ArgumentParser:
    """The HTTP front's parser, with defaults from the current environment."""
    return importlib.import_module(f"{FRONT_MODULE}.__main__").parser()


def front_variables() -> set[str]:
    """The variables the front's flags default from, as its --help names them ("env NAME")."""
    return {name for action in front_parser()._actions
            for name in re.findall(r"\benv (NANOVLLM_[A-Z0-9_]+)", action.help or "")}


def known_variables() -> set[str]:
    """Every NANOVLLM_* variable some stage or the HTTP front reads today."""
    names = library_variables() | front_variables()
    for module in STAGE_OF_UNIT.values():
        names |= parser_variables(stage_parser(module))
    return names
