"""Read systemd unit files as systemd does, so tests can check them and run what they run.

`exec_start(unit, env_file, instance)` gives the argv and environment systemd would start a
stage with: specifiers (%i, %t, %S, %C, ...) expanded, Environment= then EnvironmentFile=
(which wins), and ExecStart='s ${VAR} / $VAR / $$ expansion. It covers what the nanovllm
units use and raises ValueError on anything else rather than guess (systemd.unit(5),
systemd.exec(5), systemd.service(5) describe the full rules).
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SYSTEM_DIRS = {"t": "/run", "S": "/var/lib", "C": "/var/cache", "L": "/var/log", "E": "/etc", "T": "/tmp",
               "V": "/var/tmp"}
"""The system manager's directory specifiers (%t is the runtime directory root)."""
_DIRECTORY_SETTINGS = {"RuntimeDirectory": ("t", "RUNTIME_DIRECTORY"), "StateDirectory": ("S", "STATE_DIRECTORY"),
                       "CacheDirectory": ("C", "CACHE_DIRECTORY"), "LogsDirectory": ("L", "LOGS_DIRECTORY")}
_VAR_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


@dataclass
class Unit:
    """One unit file: its name and every (section, key, value) in file order."""
    name: str
    entries: list[tuple[str, str, str]]

    def values(self, section: str, key: str) -> list[str]:
        """Every value of a key in order; an empty assignment clears those before it (as in systemd)."""
        out: list[str] = []
        for sec, k, v in self.entries:
            if sec == section and k == key:
                out = [] if v == "" else out + [v]
        return out

    def value(self, section: str, key: str) -> str | None:
        values = self.values(section, key)
        return values[-1] if values else None


def parse_unit(path: str | os.PathLike) -> Unit:
    """Sections, keys and values, with comments dropped and backslash-continued lines joined."""
    entries, section, pending = [], None, ""
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if pending and line[:1] in ("#", ";"):
            continue  # a comment inside a continued value is skipped
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, eq, value = line.partition("=")
        if not eq or section is None:
            raise ValueError(f"{path}:{number}: not a key=value line in a section: {raw!r}")
        entries.append((section, key.strip(), value.strip()))
    return Unit(Path(path).name, entries)


def instance_name(template_name: str, instance: str) -> str:
    """'nanovllm-engine@.service' + 'prod' -> 'nanovllm-engine@prod.service'."""
    prefix, at, suffix = template_name.partition("@")
    if not at or not suffix.startswith("."):
        raise ValueError(f"{template_name} is not a template unit name")
    return f"{prefix}@{instance}{suffix}"


def expand_specifiers(text: str, unit_name: str, dirs: dict[str, str] | None = None) -> str:
    """Replace %i, %I, %n, %N, %p, %j, %%, and the directory specifiers (`dirs` overrides
    SYSTEM_DIRS), for the instantiated unit `unit_name`."""
    dirs = {**SYSTEM_DIRS, **(dirs or {})}
    stem, _, _ = unit_name.rpartition(".")
    prefix, _, instance = stem.partition("@")
    names = {"i": instance, "I": _unescape(instance), "n": unit_name, "N": stem, "p": prefix,
             "j": prefix.rpartition("-")[2], "%": "%", **dirs}

    def one(match: re.Match) -> str:
        if match.group(1) not in names:
            raise ValueError(f"specifier %{match.group(1)} in {text!r} is not supported here")
        return names[match.group(1)]
    return re.sub(r"%(.)", one, text)


def _unescape(instance: str) -> str:
    """systemd's unit name unescaping: '-' is '/', '\\xNN' a byte."""
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), instance.replace("-", "/"))


def parse_assignments(value: str) -> dict[str, str]:
    """An Environment= value: space-separated VAR=value words, each optionally quoted."""
    env = {}
    for word in shlex.split(value):
        name, eq, val = word.partition("=")
        if not eq or not re.fullmatch(_VAR_NAME, name):
            raise ValueError(f"not a VAR=value assignment: {word!r}")
        env[name] = val
    return env


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """An EnvironmentFile=."""
    return parse_env_text(Path(path).read_text(encoding="utf-8"), str(path))


def parse_env_text(text: str, origin: str = "<env>") -> dict[str, str]:
    """EnvironmentFile= syntax: VAR=value lines ('#' and ';' start comment lines); a value may be
    quoted with '...' or "...", which are removed."""
    env = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        name, eq, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not re.fullmatch(_VAR_NAME, name):
            raise ValueError(f"{origin}:{number}: not a VAR=value line: {raw!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = shlex.split(value)[0]
        env[name] = value
    return env


def expand_command(words: list[str], env: dict[str, str]) -> list[str]:
    """ExecStart= variable expansion: a word that is exactly $VAR becomes the words of the value
    (split at whitespace, quotes honoured; none if unset); ${VAR} inside a word is replaced by the
    value (empty if unset, the word stays); $$ is a literal $."""
    argv = []
    for word in words:
        whole = re.fullmatch(r"\$(" + _VAR_NAME + ")", word)
        if whole:
            argv += shlex.split(env.get(whole.group(1), ""))
            continue
        argv.append(re.sub(r"\$\$|\$\{(" + _VAR_NAME + r")\}",
                           lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), ""), word))
    return argv


def exec_start(unit_path: str | os.PathLike, env_file: str | os.PathLike | None, instance: str,
               runtime_dir: str = "/run", dirs: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment systemd would start `instance` of the template unit with.

    `env_file` stands in for the unit's EnvironmentFile= (whose path names the real /etc);
    None: no environment file. `runtime_dir` is the root %t stands for; `dirs` overrides other
    directory specifiers (e.g. {"S": ..., "C": ...}). The environment holds what the unit sets
    plus the *_DIRECTORY variables systemd adds, not the manager's own environment (PATH etc.).
    """
    unit = parse_unit(unit_path)
    name = instance_name(unit.name, instance)
    dirs = {**SYSTEM_DIRS, **(dirs or {}), "t": runtime_dir}
    expand = lambda text: expand_specifiers(text, name, dirs)  # noqa: E731
    env = {}
    for setting, (root, variable) in _DIRECTORY_SETTINGS.items():
        paths = [os.path.join(dirs[root], expand(p)) for v in unit.values("Service", setting) for p in v.split()]
        if paths:
            env[variable] = ":".join(paths)
    for value in unit.values("Service", "Environment"):
        env.update(parse_assignments(expand(value)))
    if unit.values("Service", "EnvironmentFile") and env_file is not None:
        env.update(read_env_file(env_file))
    commands = unit.values("Service", "ExecStart")
    if len(commands) != 1:
        raise ValueError(f"{unit.name}: expected one ExecStart=, found {len(commands)}")
    words = shlex.split(expand(commands[0]))
    if words[0][:1] in "@-:+!":
        raise ValueError(f"{unit.name}: ExecStart= prefixes are not supported here: {words[0]!r}")
    return expand_command(words, env), env
