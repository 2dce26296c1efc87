"""`nanovllm install-systemd`: install the systemd units that run the service's three stages and
its HTTP front.

Writes, under --prefix (default /, or a staging directory as with DESTDIR):

- `etc/systemd/system/`: `nanovllm-{tokenizer,engine,detok,http}@.service` and
  `nanovllm@.target`, with `@PYTHON@` replaced by the interpreter the stages run under;
- `etc/sysusers.d/nanovllm.conf`: the `nanovllm` user they run as;
- `etc/nanovllm/NAME.env`: the settings of instance NAME, from `nanovllm.env.example`; an
  existing file is kept, never overwritten.

The templates are the files in `systemd/` at the repository root; the package reaches them as
`nanovllm/systemd` (a link in the source tree, copies in a wheel), so an editable and a wheel
install find them alike. The units explain themselves in their comments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent / "systemd"
UNIT_FILES = ("nanovllm-tokenizer@.service", "nanovllm-engine@.service", "nanovllm-detok@.service",
              "nanovllm-http@.service", "nanovllm@.target")
SYSUSERS_FILE = "nanovllm.sysusers.conf"
ENV_EXAMPLE = "nanovllm.env.example"
STAGE_MODULES = ("tokenizer_proc", "engine_proc", "detok_proc")
HIDDEN_FROM_SERVICES = ("/home", "/root", "/run/user")
"""What ProtectHome=yes hides from the units: an interpreter or package there cannot start."""

_INSTANCE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}")
# ExecStart= would split a path at whitespace and expand '%' and '$' in it.
_UNSAFE_IN_PATH = re.compile(r"[\s\"'\\%$;]")
_PROBE = ("import importlib.util, json, sys; print(json.dumps({'base_prefix': sys.base_prefix, 'modules': "
          "{m: getattr(importlib.util.find_spec(m), 'origin', None) for m in %r}}))" % (STAGE_MODULES,))


@dataclass
class InstallResult:
    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_instance(name: str) -> None:
    """Raise ValueError unless `name` is usable as the instance of all four units and in paths."""
    if not _INSTANCE.fullmatch(name):
        raise ValueError(f"bad instance name {name!r}: use 1-64 characters from A-Z a-z 0-9 _ . : -, "
                         "starting with a letter, digit or '_' (it becomes part of unit names, "
                         "/etc/nanovllm/NAME.env and the ipc directory /run/nanovllm/NAME)")


def check_python(python: str) -> None:
    if not os.path.isabs(python):
        raise ValueError(f"--python must be an absolute path, got {python!r}")
    if _UNSAFE_IN_PATH.search(python):
        raise ValueError(f"--python {python!r}: the path may not contain whitespace, quotes, '\\', '%', '$' or ';' "
                         "(systemd would split or expand it in ExecStart=)")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"--python {python!r} is not an executable file")


def render_unit(template: str, python: str) -> str:
    text = template.replace("@PYTHON@", python)
    left = sorted(set(re.findall(r"@[A-Z_]+@", text)))
    if left:
        raise ValueError(f"unit template has placeholders install-systemd does not fill: {left}")
    return text


def install(prefix: str | os.PathLike, instance: str, python: str) -> InstallResult:
    """Write the units, the sysusers snippet and the instance's env file under `prefix`."""
    check_instance(instance)
    check_python(python)
    root = Path(prefix)
    result = InstallResult(warnings=interpreter_warnings(python))
    for name in UNIT_FILES:
        text = render_unit((TEMPLATES_DIR / name).read_text(encoding="utf-8"), python)
        result.written.append(_write(root / "etc/systemd/system" / name, text, 0o644))
    sysusers = (TEMPLATES_DIR / SYSUSERS_FILE).read_text(encoding="utf-8")
    result.written.append(_write(root / "etc/sysusers.d/nanovllm.conf", sysusers, 0o644))
    env_path = root / "etc/nanovllm" / f"{instance}.env"
    if _create_once(env_path, (TEMPLATES_DIR / ENV_EXAMPLE).read_text(encoding="utf-8")):
        result.written.append(env_path)
    else:
        result.kept.append(env_path)
    return result


def _write(path: Path, text: str, mode: int) -> Path:
    """Replace `path` whole (write a sibling, then rename): a unit is never seen half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


def _create_once(path: Path, text: str) -> bool:
    """Create `path` (mode 0600: it may come to hold secrets) unless it exists; True if created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def probe_interpreter(python: str) -> dict:
    """Where `python` finds the stage modules (None: nowhere) and its base prefix, asked without
    PYTHONPATH as systemd would run it. ValueError if it does not run as Python at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    try:
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=env, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--python {python} does not run: {e}") from None
    try:
        return json.loads(probe.stdout)
    except ValueError:
        last = (probe.stderr.strip().splitlines() or [f"no output, exit code {probe.returncode}"])[-1]
        raise ValueError(f"--python {python} does not run as a Python interpreter: {last}") from None


def interpreter_warnings(python: str) -> list[str]:
    """Why the units might fail to start with this interpreter, as far as it can be seen from here:
    stage modules it cannot import, files the `nanovllm` user cannot reach."""
    found = probe_interpreter(python)
    missing = [m for m, origin in found["modules"].items() if not origin]
    warnings = [f"{python} cannot import {', '.join(missing)} (without PYTHONPATH, as under systemd): install "
                "nanovllm into that environment, or the units will not start"] if missing else []
    paths = [os.path.realpath(python), found["base_prefix"]]
    paths += [os.path.dirname(origin) for origin in found["modules"].values() if origin]
    problems = {}  # reason -> the first path it applies to: one warning per cause
    for path in paths:
        reason = unreachable_reason(path)
        if reason:
            problems.setdefault(reason, path)
    for reason, path in problems.items():
        via = f"{python} -> {path}" if path == os.path.realpath(python) and path != python else path
        warnings.append(f"the service user cannot reach {via}: {reason}; install Python and nanovllm where every "
                        "user may read them, e.g. in a venv under /opt (python3 -m venv /opt/nanovllm)")
    return warnings


def unreachable_reason(path: str) -> str | None:
    """Why an unprivileged user of the service could not read `path`, or None if it can: under a
    directory ProtectHome= hides, or a directory on the way that others may not enter."""
    real = os.path.realpath(path)
    for hidden in HIDDEN_FROM_SERVICES:
        if real == hidden or real.startswith(hidden + "/"):
            return f"it is under {hidden}, which ProtectHome=yes hides from the units"
    parts = Path(real).parents
    for directory in reversed(parts):
        try:
            mode = os.stat(directory).st_mode
        except OSError as e:
            return f"{directory}: {e.strerror}"
        if not mode & stat.S_IXOTH:
            return f"{directory} is mode {stat.S_IMODE(mode):04o} (others may not enter it)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm install-systemd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default="/", help="install under this directory (default %(default)s)")
    parser.add_argument("--instance", default="default",
                        help="name of the instance whose env file to create (default %(default)s)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter the stages run under (default: this one, %(default)s)")
    args = parser.parse_args(argv)
    try:
        result = install(args.prefix, args.instance, args.python)
    except ValueError as e:
        print(f"nanovllm install-systemd: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"nanovllm install-systemd: cannot write {e.filename}: permission denied; run it as root, "
              "or write the files under a staging directory with --prefix DIR", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nanovllm install-systemd: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    print(next_steps(result, args.prefix, args.instance))
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def next_steps(result: InstallResult, prefix: str, instance: str) -> str:
    lines = [f"wrote {path}" for path in result.written]
    lines += [f"kept {path} (it exists; compare it with {TEMPLATES_DIR / ENV_EXAMPLE})" for path in result.kept]
    if os.path.realpath(prefix) != "/":
        lines.append(f"(staged under {prefix}: copy its etc/ to / on the machine that runs the service)")
    steps = [(f"edit /etc/nanovllm/{instance}.env", "model, address, engine settings, metrics ports"),
             ("systemd-sysusers /etc/sysusers.d/nanovllm.conf", "create the nanovllm user"),
             ("systemctl daemon-reload", "load the units"),
             (f"systemctl enable --now nanovllm@{instance}.target", "start the three stages, and at boot"),
             (f"journalctl -u 'nanovllm-*@{instance}.service' -f", "follow their logs")]
    width = max(len(command) for command, _ in steps)
    lines += ["", "Next:"] + [f"  {command.ljust(width)}  # {why}" for command, why in steps]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
