"""The systemd units in systemd/ as `nanovllm install-systemd` installs them: the files written,
`systemd-analyze verify` and `security` on the real files, the sysusers snippet, and agreement
with the stages' and the HTTP front's own flags and variables."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm import cli
from nanovllm import install_systemd as installer
from tests.ops.stages import FRONT_MODULE, FRONT_UNIT, STAGE_OF_UNIT, front_parser, known_variables, stage_parser
from tests.ops.unit_files import exec_start, parse_env_text, parse_unit

REPO = Path(__file__).resolve().parents[2]
UNITS = ("nanovllm-tokenizer@.service", "nanovllm-engine@.service", "nanovllm-detok@.service", FRONT_UNIT,
         "nanovllm@.target")
STAGES = UNITS[:3]
SERVICES = UNITS[:4]
EXPECTED_FILES = {f"etc/systemd/system/{name}" for name in UNITS} | {"etc/sysusers.d/nanovllm.conf",
                                                                      "etc/nanovllm/prod.env"}
MAX_EXPOSURE = {"nanovllm-tokenizer@.service": 2.5, "nanovllm-detok@.service": 2.5, "nanovllm-engine@.service": 4.0,
                FRONT_UNIT: 2.5}
METRICS_PORT = {"nanovllm-tokenizer@.service": "9401", "nanovllm-engine@.service": "9402",
                "nanovllm-detok@.service": "9403"}
DEFAULT_DRAIN_TIMEOUT_S = 30

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed (Debian package: systemd)")


def installed_files(prefix: Path) -> set[str]:
    return {str(p.relative_to(prefix)) for p in prefix.rglob("*") if p.is_file()}


@pytest.fixture()
def prefix(tmp_path) -> Path:
    installer.install(tmp_path, "prod", sys.executable)
    return tmp_path


def unit_path(prefix: Path, name: str) -> Path:
    return prefix / "etc/systemd/system" / name


# --- install-systemd ---------------------------------------------------------------------------


def test_install_writes_the_units_with_the_interpreter_the_sysusers_snippet_and_the_env_file(tmp_path, capsys):
    assert cli.main(["install-systemd", "--prefix", str(tmp_path), "--instance", "prod",
                     "--python", sys.executable]) == 0
    assert installed_files(tmp_path) == EXPECTED_FILES
    for name in UNITS:
        text = unit_path(tmp_path, name).read_text()
        assert "@PYTHON@" not in text
        assert text.replace(sys.executable, "@PYTHON@") == (REPO / "systemd" / name).read_text()
        assert stat.S_IMODE(unit_path(tmp_path, name).stat().st_mode) == 0o644
    for name in STAGES:
        assert f"ExecStart={sys.executable} -m {STAGE_OF_UNIT[name]} " in unit_path(tmp_path, name).read_text()
    assert f"ExecStart={sys.executable} -m {FRONT_MODULE}\n" in unit_path(tmp_path, FRONT_UNIT).read_text()
    env_file = tmp_path / "etc/nanovllm/prod.env"
    assert env_file.read_text() == (REPO / "systemd/nanovllm.env.example").read_text()
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    sysusers = (tmp_path / "etc/sysusers.d/nanovllm.conf").read_text()
    assert sysusers == (REPO / "systemd/nanovllm.sysusers.conf").read_text()
    out = capsys.readouterr().out
    for step in ("systemd-sysusers", "systemctl daemon-reload", "systemctl enable --now nanovllm@prod.target"):
        assert step in out


def test_a_second_install_keeps_the_env_file_and_rewrites_the_units(prefix, capsys):
    env_file = prefix / "etc/nanovllm/prod.env"
    env_file.write_text("NANOVLLM_MODEL=/srv/models/mine.gguf\n")
    engine = unit_path(prefix, "nanovllm-engine@.service")
    engine.write_text("[Service]\nExecStart=/bin/false\n")
    assert cli.main(["install-systemd", "--prefix", str(prefix), "--instance", "prod", "--python", sys.executable]) == 0
    assert env_file.read_text() == "NANOVLLM_MODEL=/srv/models/mine.gguf\n"
    assert f"kept {env_file}" in capsys.readouterr().out
    assert f"ExecStart={sys.executable} -m engine_proc" in engine.read_text()
    assert installed_files(prefix) == EXPECTED_FILES


def test_another_instance_adds_only_its_env_file(prefix):
    assert cli.main(["install-systemd", "--prefix", str(prefix), "--instance", "gpu-1",
                     "--python", sys.executable]) == 0
    assert installed_files(prefix) == EXPECTED_FILES | {"etc/nanovllm/gpu-1.env"}


@pytest.mark.parametrize("name", ["", "../etc", "a/b", "-x", ".hidden", "a b", "a@b", "a\\x2db", "x" * 65, "ü"])
def test_bad_instance_names_are_refused_before_anything_is_written(tmp_path, capsys, name):
    assert installer.main(["--prefix", str(tmp_path), f"--instance={name}", "--python", sys.executable]) == 2
    assert "bad instance name" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("python, message", [("python3", "must be an absolute path"),
                                             ("/no/such/python", "is not an executable file"),
                                             ("/bin/true", "does not run as a Python interpreter"),
                                             ("/opt/my python/bin/python", "may not contain whitespace")])
def test_a_bad_interpreter_is_refused_before_anything_is_written(tmp_path, capsys, python, message):
    assert installer.main(["--prefix", str(tmp_path), "--python", python]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_no_permission_to_write_is_a_clear_error(tmp_path, capsys, monkeypatch):
    target = tmp_path / "etc/systemd/system/nanovllm-tokenizer@.service"

    def refuse(path, text, mode):
        raise PermissionError(13, "Permission denied", str(target))
    monkeypatch.setattr(installer, "_write", refuse)
    assert installer.main(["--prefix", str(tmp_path), "--python", sys.executable]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {target}: permission denied" in err and "--prefix" in err


def test_paths_the_service_user_cannot_reach_are_named_with_the_reason(tmp_path):
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    reason = installer.unreachable_reason(str(hidden / "bin/python"))
    closed = re.fullmatch(r"(/\S*) is mode 0700 \(others may not enter it\)", reason or "")
    assert closed and Path(closed.group(1)) in [hidden, *hidden.parents], reason
    assert installer.unreachable_reason("/home/someone/venv/bin/python").startswith("it is under /home")
    assert installer.unreachable_reason("/root").startswith("it is under /root")
    assert installer.unreachable_reason("/usr/bin") is None


# --- systemd-analyze ---------------------------------------------------------------------------


def verify_problems(paths: list[Path]) -> list[str]:
    """`systemd-analyze verify` on the files: its exit status and every line it printed about
    them (any warning counts, not only errors)."""
    run = subprocess.run(["systemd-analyze", "verify", "--recursive-errors=yes", "--man=no", *map(str, paths)],
                         capture_output=True, text=True, timeout=120)
    ours = [line for line in (run.stdout + run.stderr).splitlines()
            if any(p.name in line or p.name.replace("@.", "@") in line or str(p) in line for p in paths)
            or "nanovllm" in line]
    return ([f"exit status {run.returncode}"] if run.returncode else []) + ours


@needs_analyze
def test_systemd_analyze_verify_passes_without_warnings(prefix):
    paths = [unit_path(prefix, name) for name in UNITS]
    assert verify_problems(paths) == []


@needs_analyze
def test_the_verify_check_sees_warnings(prefix):
    """The check above would catch a mistake: an unknown key (a warning, exit status 0) and a
    missing interpreter (an error)."""
    engine = unit_path(prefix, "nanovllm-engine@.service")
    engine.write_text(engine.read_text().replace("UMask=0077", "UMask=0077\nProtectSytem=strict"))
    assert any("Unknown key 'ProtectSytem'" in line for line in verify_problems([engine]))
    engine.write_text(engine.read_text().replace(sys.executable, "/no/such/python"))
    assert any("/no/such/python" in line for line in verify_problems([engine]))


def overall_exposure(path: Path) -> float:
    run = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(path)],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", run.stdout)
    assert found, f"no overall exposure in the output of systemd-analyze security:\n{run.stdout}{run.stderr}"
    return float(found.group(1))


@needs_analyze
@pytest.mark.parametrize("name", SERVICES)
def test_exposure_of_each_stage_is_within_its_limit(prefix, name):
    exposure = overall_exposure(unit_path(prefix, name))
    print(f"{name}: overall exposure {exposure}")
    assert exposure <= MAX_EXPOSURE[name]


@needs_analyze
def test_an_unhardened_unit_scores_high(tmp_path):
    """The parsed number is the real one: the same stage without any hardening is far above the limits."""
    bare = tmp_path / "bare@.service"
    bare.write_text(f"[Service]\nExecStart={sys.executable} -m engine_proc\n")
    assert overall_exposure(bare) > 9


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-sysusers --root writes root-owned files")
def test_the_sysusers_snippet_creates_the_user_the_units_run_as(prefix, tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run(["systemd-sysusers", f"--root={root}", str(prefix / "etc/sysusers.d/nanovllm.conf")],
                   check=True, capture_output=True, timeout=60)
    users = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    assert "nanovllm" in users and users["nanovllm"][5] == "/var/lib/nanovllm"
    for name in SERVICES:
        unit = parse_unit(unit_path(prefix, name))
        assert unit.value("Service", "User") == unit.value("Service", "Group") == "nanovllm"
        assert unit.value("Service", "StateDirectory") == "nanovllm"  # the user's home


# --- the units agree with the stages -----------------------------------------------------------


@pytest.mark.parametrize("name", STAGES)
def test_exec_start_runs_the_stage_with_flags_it_accepts(prefix, name, monkeypatch):
    argv, env = exec_start(unit_path(prefix, name), prefix / "etc/nanovllm/prod.env", "prod")
    module = STAGE_OF_UNIT[name]
    assert argv[:3] == [sys.executable, "-m", module]
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    parser = stage_parser(module)  # defaults from the unit's environment, as under systemd
    parsed = parser.parse_args(argv[3:])
    assert parsed.url == "ipc:///run/nanovllm/prod" and parsed.model == "default"


def test_the_front_takes_its_settings_from_the_unit_and_the_env_file(prefix, monkeypatch):
    """The front's ExecStart= has no flags: its address, port, model and keys come from the
    unit's defaults and the instance's env file, read by its own parser."""
    env_file = prefix / "etc/nanovllm/prod.env"
    argv, env = exec_start(unit_path(prefix, FRONT_UNIT), env_file, "prod")
    assert argv == [sys.executable, "-m", FRONT_MODULE]
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    parsed = front_parser().parse_args(argv[3:])
    assert (parsed.url, parsed.host, parsed.port, parsed.model, parsed.api_key_file) == (
        "ipc:///run/nanovllm/prod", "127.0.0.1", 8000, "default", None)
    env_file.write_text(env_file.read_text() + "NANOVLLM_MODEL=/srv/models/m\nNANOVLLM_HTTP_PORT=8101\n"
                        "NANOVLLM_HTTP_HOST=0.0.0.0\nNANOVLLM_HTTP_API_KEY_FILE=/etc/nanovllm/prod.keys\n")
    _, env = exec_start(unit_path(prefix, FRONT_UNIT), env_file, "prod")
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    parsed = front_parser().parse_args([])
    assert (parsed.host, parsed.port, parsed.model, parsed.api_key_file) == (
        "0.0.0.0", 8101, "/srv/models/m", "/etc/nanovllm/prod.keys")


@pytest.mark.parametrize("name", STAGES)
def test_exec_start_has_its_metrics_port_without_an_env_file(prefix, name):
    """Each ${VAR} on an ExecStart= line has a default in the unit, so a missing line in the env
    file never leaves a flag without its value."""
    with_file, _ = exec_start(unit_path(prefix, name), prefix / "etc/nanovllm/prod.env", "prod")
    without, _ = exec_start(unit_path(prefix, name), None, "prod")
    assert without == with_file
    assert with_file[with_file.index("--metrics-port") + 1] == METRICS_PORT[name]


def example_assignments(commented: bool) -> dict[str, str]:
    """The env example's VAR=value lines; with `commented`, its '#VAR=value' examples too."""
    text = (REPO / "systemd/nanovllm.env.example").read_text()
    if commented:
        text = re.sub(r"(?m)^#(?=NANOVLLM_)", "", text)
    return parse_env_text(text, "nanovllm.env.example")


def test_every_variable_of_the_env_example_is_read_by_a_stage(prefix):
    known = known_variables()
    exec_variables = set()
    for name in STAGES:
        command = parse_unit(unit_path(prefix, name)).value("Service", "ExecStart")
        exec_variables |= set(re.findall(r"\$\{(\w+)\}", command))
    assert exec_variables == {"NANOVLLM_TOKENIZER_METRICS_PORT", "NANOVLLM_ENGINE_METRICS_PORT",
                              "NANOVLLM_DETOK_METRICS_PORT"}
    documented = set(example_assignments(commented=True))
    unknown = documented - known - exec_variables
    assert not unknown, f"the env example names variables no stage reads: {sorted(unknown)}"
    set_in_units = {v for name in SERVICES for v in exec_start(unit_path(prefix, name), None, "prod")[1]
                    if v.startswith("NANOVLLM_")}
    assert not set_in_units - known - exec_variables, "the units set variables no stage reads"


def test_the_env_example_values_are_accepted_by_the_stages(monkeypatch):
    """Uncommenting any example line gives a value the stages parse (an int where an int goes)."""
    for variable, value in example_assignments(commented=True).items():
        monkeypatch.setenv(variable, value)
    for module in STAGE_OF_UNIT.values():
        stage_parser(module).parse_args([])
    front_parser().parse_args([])


# --- what systemd does with the units ----------------------------------------------------------


def test_the_target_groups_the_stages_and_the_front_and_orders_their_start_and_stop(prefix):
    units = {name: parse_unit(unit_path(prefix, name)) for name in UNITS}
    wants = units["nanovllm@.target"].values("Unit", "Wants")
    assert sorted(" ".join(wants).split()) == sorted(n.replace("@.", "@%i.") for n in SERVICES)
    after = {name: " ".join(units[name].values("Unit", "After")).split() for name in SERVICES}
    for name in SERVICES:
        assert units[name].value("Unit", "PartOf") == "nanovllm@%i.target"
        assert units[name].values("Unit", "Requires") == [] and units[name].values("Unit", "BindsTo") == []
    # started detok -> engine -> tokenizer -> http, so stopped http (drains its streams) ->
    # tokenizer -> engine (drains) -> detok
    assert "nanovllm-detok@%i.service" in after["nanovllm-engine@.service"]
    assert "nanovllm-engine@%i.service" in after["nanovllm-tokenizer@.service"]
    assert "nanovllm-tokenizer@%i.service" in after[FRONT_UNIT]
    assert not any(a.startswith("nanovllm-") for a in after["nanovllm-detok@.service"])
    engine = units["nanovllm-engine@.service"]
    assert seconds(engine.value("Service", "TimeoutStopSec")) >= 2 * DEFAULT_DRAIN_TIMEOUT_S
    assert seconds(engine.value("Service", "TimeoutStartSec")) >= 300
    assert engine.value("Service", "KillMode") == "mixed"
    front = units[FRONT_UNIT]
    assert seconds(front.value("Service", "TimeoutStopSec")) > front_parser().parse_args([]).drain_timeout


def test_each_stage_is_a_watched_notify_service_that_restarts_on_failure(prefix):
    for name in SERVICES:
        unit = parse_unit(unit_path(prefix, name))
        assert unit.value("Service", "Type") == "notify" and unit.value("Service", "NotifyAccess") == "main"
        assert unit.value("Service", "Restart") == "on-failure" and unit.value("Service", "RestartSec")
        assert 0 < seconds(unit.value("Service", "WatchdogSec")) <= 60
        assert unit.value("Service", "EnvironmentFile") == "/etc/nanovllm/%i.env"


def test_the_stages_share_one_kept_runtime_directory_and_the_url_points_into_it(prefix):
    for name in SERVICES:
        unit = parse_unit(unit_path(prefix, name))
        assert unit.value("Service", "RuntimeDirectory") == "nanovllm/%i"
        assert unit.value("Service", "RuntimeDirectoryPreserve") == "yes"
        assert unit.value("Service", "RuntimeDirectoryMode") == "0700"
        _, env = exec_start(unit_path(prefix, name), prefix / "etc/nanovllm/prod.env", "prod", runtime_dir="/run")
        assert env["NANOVLLM_URL"] == "ipc://" + env["RUNTIME_DIRECTORY"] == "ipc:///run/nanovllm/prod"
        # every cache the stages write lives in the unit's cache directory, HOME in its state directory
        for cache in ("NANOVLLM_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME") if name != FRONT_UNIT else ():
            assert env[cache].startswith(env["CACHE_DIRECTORY"]), cache
        assert env["HOME"] == env["STATE_DIRECTORY"]


def seconds(value: str) -> float:
    """A systemd time span such as '60', '90s', '1min 30s', '2min'."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts and "".join(n + u for n, u in parts) == value.replace(" ", ""), value
    return sum(float(n) * units[u] for n, u in parts)


# --- the package carries the templates ---------------------------------------------------------


def test_a_wheel_carries_the_templates_and_its_install_systemd_uses_them(server_wheel, tmp_path):
    wheel = server_wheel
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    for name in (*UNITS, "nanovllm.env.example", "nanovllm.sysusers.conf"):
        assert (target / "nanovllm/systemd" / name).read_bytes() == (REPO / "systemd" / name).read_bytes()
    prefix = tmp_path / "prefix"
    script = ("import sys, nanovllm.cli; print(nanovllm.cli.__file__, file=sys.stderr); "
              "sys.exit(nanovllm.cli.main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", script, "install-systemd", "--prefix", str(prefix),
                          "--instance", "prod", "--python", sys.executable],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(target)))
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith(str(target / "nanovllm/cli.py"))  # the wheel's code, not the repository's
    assert installed_files(prefix) == EXPECTED_FILES
