"""tests/ops/unit_files.py expands a unit's ExecStart= as systemd does."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nanovllm import install_systemd as installer
from tests.ops.unit_files import exec_start, expand_command, expand_specifiers, parse_unit

UNIT = r"""# a comment
[Unit]
Description=demo %i

[Service]
; another comment
Environment=DROPPED=1
Environment=
Environment=GREETING="hello world" NAME=%i
Environment="ARGS=--one\
  --two"
Environment=PLAIN=%I
Environment=FROM_UNIT=unit OVERRIDDEN=unit WHERE=%t/demo/%i NAME=%n LITERAL=100%%
EnvironmentFile=/etc/demo/%i.env
RuntimeDirectory=demo/%i
CacheDirectory=demo
ExecStart=/usr/bin/demo --name=${NAME} $ARGS --greeting ${GREETING} $UNSET ${UNSET} --cost $$5 --where ${WHERE}
"""


@pytest.fixture()
def demo(tmp_path) -> tuple[Path, Path]:
    unit = tmp_path / "demo@.service"
    unit.write_text(UNIT)
    env = tmp_path / "demo.env"
    env.write_text("# settings\nOVERRIDDEN=file\nGREETING='hi there'\n\nEMPTY=\n")
    return unit, env


def test_exec_start_expands_specifiers_and_variables_like_systemd(demo):
    unit, env_file = demo
    argv, env = exec_start(unit, env_file, "a-b", runtime_dir="/tmp/rt", dirs={"C": "/tmp/cache"})
    assert argv == ["/usr/bin/demo", "--name=demo@a-b.service", "--one", "--two", "--greeting", "hi there", "",
                    "--cost", "$5", "--where", "/tmp/rt/demo/a-b"]
    assert env == {"RUNTIME_DIRECTORY": "/tmp/rt/demo/a-b", "CACHE_DIRECTORY": "/tmp/cache/demo",
                   "GREETING": "hi there", "NAME": "demo@a-b.service", "ARGS": "--one --two", "PLAIN": "a/b",
                   "FROM_UNIT": "unit", "OVERRIDDEN": "file", "WHERE": "/tmp/rt/demo/a-b", "LITERAL": "100%",
                   "EMPTY": ""}


def test_without_an_env_file_the_unit_environment_stands(demo):
    unit, _ = demo
    argv, env = exec_start(unit, None, "x")
    assert env["OVERRIDDEN"] == "unit" and env["GREETING"] == "hello world"
    assert "DROPPED" not in env  # an empty Environment= clears the assignments before it
    assert argv[4:8] == ["--greeting", "hello world", "", "--cost"]  # ${UNSET}: an empty word; $UNSET: none


def test_specifiers():
    name = "nanovllm-engine@gpu-0.service"
    assert expand_specifiers("%i %I %n %N %p %j", name) == \
        "gpu-0 gpu/0 nanovllm-engine@gpu-0.service nanovllm-engine@gpu-0 nanovllm-engine engine"
    assert expand_specifiers("%t %S %C %L %E 100%%", name) == "/run /var/lib /var/cache /var/log /etc 100%"
    with pytest.raises(ValueError, match="%Z"):
        expand_specifiers("%Z", name)


def test_dollar_forms():
    env = {"A": "x y", "B": "z"}
    assert expand_command(["$A", "${A}", "pre${B}post", "$B$B", "$$A", "$NONE"], env) == \
        ["x", "y", "x y", "prezpost", "$B$B", "$A"]


def test_unsupported_exec_prefixes_are_refused(tmp_path):
    unit = tmp_path / "x@.service"
    unit.write_text("[Service]\nExecStart=-/bin/true\n")
    with pytest.raises(ValueError, match="prefixes"):
        exec_start(unit, None, "i")


def test_the_engine_unit_line_with_and_without_overrides(tmp_path):
    installer.install(tmp_path, "prod", sys.executable)
    engine = tmp_path / "etc/systemd/system/nanovllm-engine@.service"
    env_file = tmp_path / "etc/nanovllm/prod.env"
    argv, env = exec_start(engine, env_file, "prod", runtime_dir="/tmp/r")
    assert argv == [sys.executable, "-m", "engine_proc", "--metrics-port", "9402"]
    assert env["NANOVLLM_URL"] == "ipc:///tmp/r/nanovllm/prod"
    env_file.write_text("NANOVLLM_ENGINE_METRICS_PORT=9502\nNANOVLLM_URL=tcp://127.0.0.1:5550\n")
    argv, env = exec_start(engine, env_file, "prod")
    assert argv[-1] == "9502" and env["NANOVLLM_URL"] == "tcp://127.0.0.1:5550"
    assert parse_unit(engine).values("Unit", "After") == ["network.target nanovllm-detok@%i.service"]
