"""Where each stage listens, derived from one service address.

A service is named by one URL, so a client needs one string and two instances on one host differ
in one string (systemd template units):

- ``ipc:///run/nanovllm`` (a directory) -> ``ipc:///run/nanovllm/{tokenizer,stream,engine,detok,control}.sock``
- ``tcp://127.0.0.1:5550`` -> tokenizer on port 5550, stream 5551, engine 5552, detok 5553, control 5554.

Each stage can still be given each endpoint explicitly (flags / NANOVLLM_* environment).
"""
from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass

from .errors import NanovllmError

try:
    import pwd
except ImportError:  # not on Unix
    pwd = None  # type: ignore[assignment]

_TCP_OFFSETS = {"tokenizer": 0, "stream": 1, "engine": 2, "detok": 3, "control": 4}


@dataclass(frozen=True)
class Endpoints:
    tokenizer: str
    """Tokenizer ROUTER: clients send requests and aborts here."""
    stream: str
    """Detokenizer ROUTER: clients receive their streamed outputs here."""
    engine: str
    """Engine PULL: tokenized requests (from the tokenizer); not read while the engine's queue is full."""
    detok: str
    """Detokenizer PULL: the engine's step outputs."""
    control: str
    """Engine PULL: aborts (from tokenizer and detokenizer) and detokenizer hellos, read whatever
    the load, so an abort never waits behind the requests that fill the engine's queue."""


def default_runtime_dir() -> str:
    """$NANOVLLM_RUNTIME_DIR, else $XDG_RUNTIME_DIR/nanovllm, else <tmp>/nanovllm-<uid>."""
    if os.environ.get("NANOVLLM_RUNTIME_DIR"):
        return os.environ["NANOVLLM_RUNTIME_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "nanovllm")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"nanovllm-{uid}")


def default_url() -> str:
    """$NANOVLLM_URL, else the ipc directory of `default_runtime_dir()`."""
    return os.environ.get("NANOVLLM_URL") or f"ipc://{default_runtime_dir()}"


def service_endpoints(url: str) -> Endpoints:
    """One service URL -> the five stage endpoints (see the module docstring)."""
    if url.startswith("ipc://"):
        base = url[len("ipc://"):].rstrip("/")
        if not base:
            raise ValueError(f"ipc service URL needs a directory path, got {url!r}")
        return Endpoints(*(f"ipc://{base}/{name}.sock" for name in _TCP_OFFSETS))
    if url.startswith("tcp://"):
        host, sep, port = url[len("tcp://"):].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"tcp service URL must look like tcp://HOST:PORT, got {url!r}")
        base_port = int(port)
        last = len(_TCP_OFFSETS) - 1
        if not 0 < base_port <= 65535 - last:
            raise ValueError(f"tcp base port must be in 1..{65535 - last} ({last + 1} consecutive ports are used), "
                             f"got {base_port}")
        return Endpoints(*(f"tcp://{host}:{base_port + off}" for off in _TCP_OFFSETS.values()))
    raise ValueError(f"service URL must start with ipc:// or tcp://, got {url!r}")


class UnsafeRuntimeDirError(NanovllmError, PermissionError):
    """An ipc:// directory another user made, or could change: sockets in it may be anyone's.
    The message names the path, what is wrong with it (owner, mode, link) and the fix."""


def ipc_dir(endpoint: str) -> str | None:
    """The directory of an ipc:// endpoint; None for tcp or a bare socket name."""
    if not endpoint.startswith("ipc://"):
        return None
    return os.path.dirname(endpoint[len("ipc://"):]) or None


def ensure_private_dir(directory: str) -> None:
    """Make `directory` (mode 0700), or take an existing one only if it is this user's own
    private directory: a real directory, not a symlink, owned by the effective uid, no
    group or other bits. Stages and `nanovllm serve` call it before binding or writing there.

    Where the default directory lies in a shared place ($TMPDIR/nanovllm-UID when
    XDG_RUNTIME_DIR is unset), another user can make it first and own every socket and file
    in it: such a directory is refused, never fixed up (its owner could change it back)."""
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # exact, whatever the umask
        return
    except FileExistsError:
        pass
    problem = _private_dir_problem(directory)
    if problem:
        raise UnsafeRuntimeDirError(problem)


def check_ipc_endpoint(endpoint: str) -> None:
    """Before a client connects to an ipc:// endpoint: refuse a directory another user could
    have put sockets in (`check_trusted_dir`)."""
    directory = ipc_dir(endpoint)
    if directory is not None:
        check_trusted_dir(directory)


def check_trusted_dir(directory: str) -> None:
    """Before a client uses what a service put in `directory` (its sockets, its instance key):
    refuse a directory another user could have put things in. Accepted: this user's private
    directory (as `ensure_private_dir`), or a directory in a place only root can write (systemd's
    RuntimeDirectory under /run, owned by the service's user), not writable by group or others.
    A missing directory in a shared place is made here, private, so no one else can make it
    before the service starts."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        if _writable_by_others(os.path.dirname(os.path.abspath(directory))):
            ensure_private_dir(directory)
        return  # else only root (or this user) can make it: zmq retries until the service does
    if info.st_uid == os.geteuid():
        problem = _private_dir_problem(directory)
    elif stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = _private_dir_problem(directory)
    elif info.st_mode & 0o022 or _writable_by_others(os.path.dirname(os.path.abspath(directory))):
        problem = (f"runtime directory {directory} belongs to {_owner(info.st_uid)}"
                   f"{_mode_text(info.st_mode, 0o022)} and lies where other users can make directories; "
                   f"a service of another user must run from a directory only root can make (e.g. systemd's "
                   f"RuntimeDirectory under /run), one of your own from yours")
    else:
        problem = None
    if problem:
        raise UnsafeRuntimeDirError(problem)


def _private_dir_problem(directory: str) -> str | None:
    info = os.lstat(directory)
    fix = (f"remove it if it is not yours (rm -r {directory}) or point the service elsewhere "
           f"(--runtime-dir, NANOVLLM_RUNTIME_DIR, XDG_RUNTIME_DIR)")
    if stat.S_ISLNK(info.st_mode):
        return f"runtime directory {directory} is a symbolic link (to {os.readlink(directory)!r}); {fix}"
    if not stat.S_ISDIR(info.st_mode):
        return f"runtime directory {directory} is not a directory; {fix}"
    if info.st_uid != os.geteuid():
        return f"runtime directory {directory} belongs to {_owner(info.st_uid)}, not to you ({_owner(os.geteuid())}); {fix}"
    if info.st_mode & 0o077:
        return (f"runtime directory {directory} has mode {stat.S_IMODE(info.st_mode):04o}: other users may use it; "
                f"chmod 700 {directory} if only you made what is in it, else remove it")
    return None


def _writable_by_others(directory: str) -> bool:
    """Whether a user other than root and this one may make entries in `directory`."""
    try:
        info = os.stat(directory)
    except OSError:
        return True
    return info.st_uid not in (0, os.geteuid()) or bool(info.st_mode & 0o022)


def _mode_text(mode: int, bits: int) -> str:
    return f" with mode {stat.S_IMODE(mode):04o}" if mode & bits else ""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (AttributeError, KeyError):  # no pwd module here, or a uid without a name
        return f"uid {uid}"
