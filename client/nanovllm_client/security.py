"""CURVE for clients, and the key files both sides read: a client's socket setup, its keys (given,
from the environment, or a loopback service's instance key), and its routing id.

A service's stages share one key pair; each client has a pair of its own, let in by the service's
allow-list (`nanovllm.service.security` is the server half: socket setup, the authenticator, the
allow-list, `nanovllm keygen`). A service on loopback tcp given no keys makes a key pair of its own
on first use (its *instance* key, `ensure_instance_key`) in its private runtime directory:
loopback keeps other hosts out, not other users of this one. Clients of the same user (and root)
find it there and use it, or make it if they come first (`client_curve`); nobody else can read
it. Only `--insecure-tcp` (and $NANOVLLM_INSECURE_TCP for clients) runs tcp without CURVE.

Key files use the zmq certificate format (`zmq.auth.load_certificate` reads them). Imports only
pyzmq and the standard library.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.utils import z85

from .endpoints import check_trusted_dir, default_runtime_dir, ensure_private_dir, service_endpoints

INSECURE_TCP_ENV = "NANOVLLM_INSECURE_TCP"
"""Set to 1 for tcp without CURVE: a stage may then bind any tcp address without keys, and a
client of a loopback service connects without its instance key."""
CLIENT_KEY_ENV = "NANOVLLM_CURVE_CLIENT_KEY"
"""A client's own secret key file."""
SERVER_KEY_ENV = "NANOVLLM_CURVE_SERVER_KEY"
"""The service's public key file, for clients."""
SERVICE_KEY_ENV = "NANOVLLM_CURVE_SECRET_KEY"
"""The service's own secret key file, as its stages read it (`nanovllm serve --curve-secret-key`,
an instance's env file under systemd). The HTTP front beside the service connects with that pair
(`service_pair_env`)."""

INSTANCE_KEY_PREFIX = "curve-"
"""Instance key files: `<runtime dir>/curve-<host>_<port>.key_secret`."""
KEY_TAG_BYTES = 8
"""Under CURVE a client's routing id starts with this many bytes derived from its public key."""
MAX_PRIORITY_FIELD = "max-priority"
"""A client's public key file may carry `max-priority = "N"` in its metadata: that key's priority
ceiling once the file is in a service's allow-list."""

PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"
MAX_KEY_FILE_BYTES = 64 * 1024


class KeyFileError(ValueError):
    """A key file is missing, unreadable or not a CURVE key; the message names the file."""


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, each key 40 bytes of z85 text."""
    public: bytes
    secret: bytes = field(repr=False)


# ---------------------------------------------------------------------------------- key files

def generate_keypair(directory: str, name: str, max_priority: int | None = None) -> tuple[str, str]:
    """Write `DIR/NAME.key` (public) and `DIR/NAME.key_secret` (secret, mode 0600); the directory
    is created 0700 if missing. Returns (public file, secret file). Never overwrites a key.
    `max_priority`: written into the public file, the ceiling a service gives this key's requests
    once the file is in its allow-list."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or not name.isprintable():
        raise ValueError(f"a key name must be a plain file name (no directories), got {name!r}")
    if max_priority is not None and (not isinstance(max_priority, int) or isinstance(max_priority, bool)
                                     or not -2**31 <= max_priority < 2**31):
        raise ValueError(f"max_priority must be a 32-bit integer, got {max_priority!r}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_file = os.path.join(directory, name + PUBLIC_SUFFIX)
    secret_file = os.path.join(directory, name + SECRET_SUFFIX)
    for path in (public_file, secret_file):
        if os.path.lexists(path):
            raise FileExistsError(f"{path} already exists; refusing to overwrite a key "
                                  "(move it away first, or choose another name)")
    public, secret = zmq.curve_keypair()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    _write_new(secret_file, _certificate(f"CURVE **secret** key of {name!r}, made {now}. "
                                         "Keep it private: never copy it off its host.", public, secret), 0o600)
    try:
        _write_new(public_file, _certificate(f"CURVE public key of {name!r}, made {now}.", public,
                                             max_priority=max_priority), 0o644)
    except BaseException:
        os.unlink(secret_file)  # half a key pair is worse than none
        raise
    return public_file, secret_file


def load_keypair(secret_file: str) -> CurveKeys:
    """The key pair in a `NAME.key_secret` file."""
    public, secret = _read_key_file(secret_file)
    if secret is None:
        raise KeyFileError(f"{secret_file}: holds no secret key (a public .key file? give the {SECRET_SUFFIX} file)")
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{secret_file}: its public key does not belong to its secret key (file edited?)")
    mode = os.stat(secret_file).st_mode
    if hasattr(os, "getuid") and mode & 0o077:
        # Whoever can read it can be the service: a warning would leave it so.
        raise KeyFileError(f"{secret_file}: a secret key with mode {stat.S_IMODE(mode):04o} that other users "
                           f"may read or write; refusing it. chmod 600 {secret_file} (and make a new pair if "
                           "someone may have copied it)")
    return CurveKeys(public, secret)


def load_public_key(file: str) -> bytes:
    """The public key in a key file (either of the pair), as z85 bytes."""
    return _read_key_file(file)[0]


def _certificate(comment: str, public: bytes, secret: bytes | None = None, max_priority: int | None = None) -> str:
    lines = [f"#   {comment}", "#   ZeroMQ CURVE certificate, written by nanovllm keygen", "", "metadata"]
    if max_priority is not None:
        lines.append(f'    {MAX_PRIORITY_FIELD} = "{max_priority}"')
    lines += ["curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_new(path: str, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # O_EXCL: no overwrite, no race
    with os.fdopen(fd, "w", encoding="ascii") as f:
        if mode & 0o077 == 0:
            os.fchmod(fd, mode)  # exact, whatever the umask
        f.write(text)


def _read_key_file(path: str) -> tuple[bytes, bytes | None]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file") from None
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the key file ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE_BYTES:  # reading a FIFO would block
        raise KeyFileError(f"{path}: not a key file (a directory, a device, or too large)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the key file ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError):
        raise KeyFileError(f"{path}: not a CURVE key file (no public-key line; "
                           "expected the zmq certificate format that `nanovllm keygen` writes)") from None
    for which, key in (("public", public), ("secret", secret)):
        if key is not None and not _is_z85_key(key):
            raise KeyFileError(f"{path}: the {which} key is not a 40-character z85 CURVE key")
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except Exception:  # z85.decode raises KeyError/ValueError/struct.error on bad text
        return False


# ---------------------------------------------------------------------------------- binding

def exposure(endpoint: str) -> str | None:
    """Why other hosts could reach a bind on `endpoint`, or None if only this host can.

    No DNS: only literal addresses, `localhost` and `*` are understood; any other host or
    interface name counts as reachable (say 127.0.0.1 to mean loopback)."""
    transport, sep, address = endpoint.partition("://")
    if not sep:
        raise ValueError(f"not a zmq endpoint: {endpoint!r}")
    if transport in ("ipc", "inproc"):
        return None
    if transport != "tcp":
        raise ValueError(f"a stage binds only ipc:// or tcp:// endpoints, got {endpoint!r}")
    host = address.rpartition(":")[0]
    if host == "*":
        return "a wildcard address listens on every interface"
    if host.lower() == "localhost":
        return None
    try:
        ip = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return f"{host!r} is not a literal IP address (no DNS here; use 127.0.0.1 for loopback)"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return None
    return f"{host} listens on every interface" if ip.is_unspecified else f"{host} is not a loopback address"


def check_unused(sock: zmq.Socket) -> None:
    # libzmq copies a socket's options at bind/connect: CURVE set later would silently not apply.
    if sock.getsockopt(zmq.LAST_ENDPOINT):
        raise RuntimeError("set up CURVE before the socket binds or connects: it is already bound or connected")


# ---------------------------------------------------------------------------------- clients

def client_socket_security(sock: zmq.Socket, client_keys: CurveKeys, server_public_key: bytes) -> None:
    """Make a socket a CURVE client of the service whose public key is given. Call before connect."""
    if not isinstance(server_public_key, bytes) or not _is_z85_key(server_public_key):
        raise ValueError("server_public_key must be a 40-byte z85 CURVE public key (see load_public_key)")
    check_unused(sock)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client_keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client_keys.secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)


def client_keys_from_env(environ: Mapping[str, str] | None = None) -> tuple[CurveKeys, bytes] | None:
    """(client key pair, service public key) from $NANOVLLM_CURVE_CLIENT_KEY and
    $NANOVLLM_CURVE_SERVER_KEY; None when neither is set, ValueError when only one is."""
    env = os.environ if environ is None else environ
    client_file, server_file = env.get(CLIENT_KEY_ENV) or None, env.get(SERVER_KEY_ENV) or None
    if client_file is None and server_file is None:
        return None
    if client_file is None or server_file is None:
        missing = CLIENT_KEY_ENV if client_file is None else SERVER_KEY_ENV
        raise ValueError(f"CURVE needs both {CLIENT_KEY_ENV} (this client's .key_secret file) and "
                         f"{SERVER_KEY_ENV} (the service's .key file); {missing} is not set")
    return load_keypair(client_file), load_public_key(server_file)


def service_pair_env(secret_key: str) -> dict[str, str]:
    """The client key variables that make a client use the service's own key pair, which the
    service lets in everywhere: its secret key file is both the client key and, read for its
    public half, the server key. File paths, never a key on a command line. `nanovllm serve` gives
    them to its HTTP front, and the front under its systemd unit derives them itself from
    $NANOVLLM_CURVE_SECRET_KEY: one rule for both."""
    path = os.path.abspath(secret_key)
    return {CLIENT_KEY_ENV: path, SERVER_KEY_ENV: path}


def client_curve(url: str, curve: tuple[CurveKeys, bytes] | None = None,
                 environ: Mapping[str, str] | None = None, insecure_tcp: bool = False
                 ) -> tuple[CurveKeys, bytes] | None:
    """The CURVE keys a client of `url` uses: `curve` if given, else the key files named by
    $NANOVLLM_CURVE_CLIENT_KEY / $NANOVLLM_CURVE_SERVER_KEY, else, for a service on loopback tcp,
    its instance key (`instance_keys`) unless `insecure_tcp` or $NANOVLLM_INSECURE_TCP says it runs
    with --insecure-tcp; None: no CURVE (ipc, or a tcp service elsewhere that runs without it)."""
    if curve is not None:
        return curve
    env = os.environ if environ is None else environ
    from_files = client_keys_from_env(env)
    if from_files is not None:
        return from_files
    insecure_tcp = insecure_tcp or env.get(INSECURE_TCP_ENV, "0").lower() in ("1", "true", "yes", "on")
    if insecure_tcp or not url.startswith("tcp://"):
        return None
    return instance_keys(url) if exposure(service_endpoints(url).tokenizer) is None else None


def key_tag(public_key: bytes | str) -> bytes:
    """The first bytes of the routing id of every client holding this public key (z85 text)."""
    text = public_key.encode("ascii") if isinstance(public_key, str) else public_key
    return hashlib.blake2b(text, digest_size=KEY_TAG_BYTES).digest()


def new_routing_id(curve: tuple[CurveKeys, bytes] | None) -> bytes:
    """A client's routing id: 16 random bytes; under CURVE, its key's tag then 8 random bytes, so
    a stage refuses the id from any other key (`claimed_id`) and no key can take over another's
    streams by reconnecting under its id."""
    if curve is None:
        return uuid.uuid4().bytes
    return key_tag(curve[0].public) + os.urandom(16 - KEY_TAG_BYTES)


# ---------------------------------------------------------------------------------- instance keys

def instance_key_file(url: str, runtime_dir: str | None = None) -> str:
    """Where the instance key of the tcp service at `url` lives: its runtime directory (default
    `default_runtime_dir()`), named by host and port so services on one host keep theirs apart."""
    address = url.partition("://")[2]
    name = re.sub(r"[^A-Za-z0-9.-]", "_", address)
    return os.path.join(runtime_dir or default_runtime_dir(), f"{INSTANCE_KEY_PREFIX}{name}{SECRET_SUFFIX}")


def ensure_instance_key(url: str, runtime_dir: str | None = None) -> str:
    """The instance key file of the service at `url`, made on first use (mode 0600, in the
    private runtime directory); the stages of one service share it, and whichever stage comes
    first makes it (a fresh pair linked into place: the others find the winner's). Delete the file
    and restart the service to change the pair."""
    path = instance_key_file(url, runtime_dir)
    directory = os.path.dirname(path)
    ensure_private_dir(directory)
    if not os.path.lexists(path):
        scratch = tempfile.mkdtemp(prefix=".keys.", dir=directory)
        try:
            _, secret = generate_keypair(scratch, "instance")
            try:
                os.link(secret, path)  # atomic, and never over a file another stage just made
            except FileExistsError:
                pass
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    load_keypair(path)  # a file it cannot use is an error now, not a failed handshake later
    return path


def instance_keys(url: str) -> tuple[CurveKeys, bytes]:
    """(the instance key pair, its public key) of the loopback tcp service at `url`, from this
    user's runtime directory ($NANOVLLM_RUNTIME_DIR names another: a systemd instance's, which root
    may read). A client that comes before the service makes it, as a stage would: whoever is first
    makes the pair, the others use it."""
    path = instance_key_file(url)
    if os.path.exists(path):
        check_trusted_dir(os.path.dirname(path))  # a key another user planted would be theirs to read
    else:
        ensure_instance_key(url)
    keys = load_keypair(path)
    return keys, keys.public


def add_client_key_flags(parser) -> None:
    """A client's CURVE flags (an argparse parser's --curve-client-key, --curve-server-key and
    --insecure-tcp, each defaulting to its environment variable): one set for every client CLI."""
    parser.add_argument("--curve-client-key", default=os.environ.get(CLIENT_KEY_ENV),
                        help=f"this client's CURVE secret key file, for a service that requires keys (env {CLIENT_KEY_ENV})")
    parser.add_argument("--curve-server-key", default=os.environ.get(SERVER_KEY_ENV),
                        help=f"the service's CURVE public key file (env {SERVER_KEY_ENV})")
    parser.add_argument("--insecure-tcp", action="store_true",
                        default=os.environ.get(INSECURE_TCP_ENV, "0").lower() in ("1", "true", "yes", "on"),
                        help="connect to a tcp service run with --insecure-tcp: no CURVE (by default a loopback "
                             f"service is reached with its instance key; env {INSECURE_TCP_ENV}=1)")
