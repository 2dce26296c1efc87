"""CURVE security for the service's sockets: key files, socket setup, and who may connect.

One key pair per service instance (the "server" pair) is shared by its three stages: each stage's
bound sockets are CURVE servers with its secret key, and a stage's PUSH to another stage is a
CURVE client using that same pair. Each client has a pair of its own and is let in by putting its
public key file into the service's allow-list directory. A `zmq.auth` authenticator thread per
stage (per zmq.Context) answers the handshakes.

A service on loopback tcp given no keys makes a key pair of its own on first use (its *instance*
key, `ensure_instance_key`), in its private runtime directory: loopback keeps other hosts out, not
other users of this one. Clients of the same user (and root) find it there and use it, or make
it if they come first (`client_curve`); nobody else can read it. Only `--insecure-tcp` (and
$NANOVLLM_INSECURE_TCP for clients) runs tcp without CURVE, and a
stage refuses to bind a tcp address other hosts can reach without keys unless told it may
(`check_bind`).

Key files use the zmq certificate format (`zmq.auth.load_certificate` reads them). Imports only
pyzmq and the standard library: the client library uses it too.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .endpoints import check_trusted_dir, default_runtime_dir, ensure_private_dir, service_endpoints

SECRET_KEY_ENV = "NANOVLLM_CURVE_SECRET_KEY"
"""A stage's service secret key file (`NAME.key_secret`)."""
CLIENTS_DIR_ENV = "NANOVLLM_CURVE_CLIENTS"
"""A stage's allow-list: a directory of client public key files (`*.key`)."""
INSECURE_TCP_ENV = "NANOVLLM_INSECURE_TCP"
"""Set to 1 to let a stage bind a non-loopback tcp address without keys."""
CLIENT_KEY_ENV = "NANOVLLM_CURVE_CLIENT_KEY"
"""A client's own secret key file."""
SERVER_KEY_ENV = "NANOVLLM_CURVE_SERVER_KEY"
"""The service's public key file, for clients."""

INSTANCE_KEY_PREFIX = "curve-"
"""Instance key files: `<runtime dir>/curve-<host>_<port>.key_secret`."""
KEY_TAG_BYTES = 8
"""Under CURVE a client's routing id starts with this many bytes derived from its public key."""
MAX_PRIORITY_FIELD = "max-priority"
"""An allow-list key file may carry `max-priority = "N"` in its metadata: that key's ceiling."""

CLIENT_DOMAIN = b"nanovllm.clients"
"""ZAP domain of client-facing sockets: the service's own key and the allow-list get in."""
PIPELINE_DOMAIN = b"nanovllm.pipeline"
"""ZAP domain of stage-to-stage sockets: only the service's own key gets in."""
PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"
MAX_KEY_FILE_BYTES = 64 * 1024

log = logging.getLogger("nanovllm.security")


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


_METADATA_LINE = re.compile(r'^\s+([A-Za-z0-9_-]+)\s*=\s*"([^"]*)"\s*$')


def read_max_priority(path: str) -> int | None:
    """The `max-priority` a key file's metadata section gives its key, or None; KeyFileError for a
    value that is not a 32-bit integer (better refused than read as no ceiling)."""
    with open(path, encoding="ascii", errors="replace") as f:
        text = f.read(MAX_KEY_FILE_BYTES)
    section = None
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.strip()
            continue
        match = _METADATA_LINE.match(line)
        if section == "metadata" and match and match.group(1) == MAX_PRIORITY_FIELD:
            value = match.group(2)
            if not re.fullmatch(r"-?[0-9]{1,10}", value) or not -2**31 <= int(value) < 2**31:
                raise KeyFileError(f"{path}: {MAX_PRIORITY_FIELD} must be a 32-bit integer, got {value!r}")
            return int(value)
    return None


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


# ---------------------------------------------------------------------------------- authentication

class AllowList:
    """The client public keys in a directory of `*.key` files (other files are ignored), each
    with the priority ceiling its file may carry (`max-priority` in its metadata).

    Re-read on every call: one directory scan, and a file is parsed again only when its size,
    mtime or inode changed. A key file added or removed takes effect at the next handshake; a
    connection already made stays. An unreadable or malformed file is skipped (logged once)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict[str, tuple[tuple[int, int, int, int], bytes | None, int | None]] = {}
        self._readable = True

    def keys(self) -> set[bytes]:
        return set(self.entries())

    def max_priority(self, key: bytes) -> int | None:
        """The ceiling an allow-list file gives `key` (the lowest, if several files hold it)."""
        return self.entries().get(key)

    def entries(self) -> dict[bytes, int | None]:
        """Each allowed key and its priority ceiling (None: the service's own applies)."""
        try:
            entries = [e for e in os.scandir(self.directory) if e.name.endswith(PUBLIC_SUFFIX)]
        except OSError as e:
            if self._readable:  # logged when it breaks, not at every handshake
                log.warning("cannot read the client allow-list %s (%s): no client gets in", self.directory, e.strerror)
            self._files, self._readable = {}, False
            return {}
        self._readable = True
        files = {}
        for entry in entries:
            try:
                st = entry.stat()
            except OSError:
                continue  # removed while scanning
            signature = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode)
            cached = self._files.get(entry.name)
            if cached is not None and cached[0] == signature:
                files[entry.name] = cached
                continue
            files[entry.name] = (signature, *self._read(entry.path, st.st_mode))
        self._files = files
        allowed: dict[bytes, int | None] = {}
        for _, key, ceiling in files.values():
            if key is None:
                continue
            ceilings = [c for c in (allowed.get(key), ceiling) if c is not None]
            allowed[key] = min(ceilings) if ceilings else None
        return allowed

    @staticmethod
    def _read(path: str, mode: int) -> tuple[bytes | None, int | None]:
        try:
            if mode & 0o022:
                raise KeyFileError(f"{path}: mode {stat.S_IMODE(mode):04o} lets other users "
                                   f"replace the key in it; chmod go-w {path}")
            return load_public_key(path), read_max_priority(path)
        except (KeyFileError, OSError) as e:
            log.warning("skipping a client key: %s", e)
            return None, None


class _KeyCheck:
    """A zmq.auth credentials provider. It must never raise: an exception would end the
    authenticator thread, after which every handshake waits forever for its answer."""

    def __init__(self, name: str, is_allowed: Callable[[bytes], bool]):
        self.name, self.is_allowed = name, is_allowed
        self._logged: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            if self.is_allowed(key):
                return True
        except Exception:
            log.exception("checking a CURVE key for %s failed; refusing it", self.name)
            return False
        if key not in self._logged and len(self._logged) < 1024:  # once per key: no log flood
            self._logged.add(key)
            log.warning("refused a %s connection: unknown CURVE key %s", self.name, key.decode("ascii", "replace"))
        return False


class ServiceSecurity:
    """CURVE for one stage: socket setup and the authenticator thread on the stage's context.

    With `keys`, every socket set up by `server`/`pipeline_server`/`client` speaks CURVE, and an
    authenticator (at most one per zmq.Context: it binds the context's ZAP endpoint) admits the
    service's own key everywhere and the keys in `allowed_clients_dir` on client-facing sockets.
    Without keys the setup calls do nothing and only `check_bind` applies. Call `close()` (or use
    `with`) before terminating the context."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None, allowed_clients_dir: str | None,
                 insecure_tcp: bool = False):
        if allowed_clients_dir is not None and keys is None:
            raise ValueError(f"a client allow-list ({CLIENTS_DIR_ENV}) needs the service's secret key "
                             f"({SECRET_KEY_ENV}): without keys nobody is checked")
        if allowed_clients_dir is not None and not os.path.isdir(allowed_clients_dir):
            raise ValueError(f"client allow-list directory {allowed_clients_dir} does not exist "
                             f"({CLIENTS_DIR_ENV}: a directory of client *{PUBLIC_SUFFIX} files)")
        if allowed_clients_dir is not None and os.stat(allowed_clients_dir).st_mode & 0o022:
            mode = stat.S_IMODE(os.stat(allowed_clients_dir).st_mode)
            raise ValueError(f"client allow-list directory {allowed_clients_dir} has mode {mode:04o}: other users "
                             f"could add their own keys to it and get in. chmod go-w {allowed_clients_dir}")
        if keys is not None and not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE support")
        self.ctx, self.keys, self.insecure_tcp = ctx, keys, insecure_tcp
        self.allow_list = AllowList(allowed_clients_dir) if allowed_clients_dir is not None else None
        self._authenticator: ThreadAuthenticator | None = None
        if keys is not None:
            self._authenticator = self._start_authenticator(keys)

    @classmethod
    def from_files(cls, ctx: zmq.Context, secret_key_file: str | None, allowed_clients_dir: str | None,
                   insecure_tcp: bool = False) -> ServiceSecurity:
        """From a stage's flags: the service's secret key file (or None) and the allow-list dir."""
        keys = load_keypair(secret_key_file) if secret_key_file else None
        return cls(ctx, keys, allowed_clients_dir or None, insecure_tcp)

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def tenant_key(self, key: str | None) -> str | None:
        """The client a frame authenticated as `key` (ZAP's User-Id) counts as for per-client
        salts, limits and ceilings: its key, except the service's own (its stages, the supervisor,
        and clients of the service's user sharing its instance key), whose connections are told
        apart by routing id as without CURVE (None)."""
        if key is None or self.keys is None or key.encode("ascii", "replace") == self.keys.public:
            return None
        return key

    def max_priority_of(self, key: str | None) -> int | None:
        """The priority ceiling the allow-list gives `key` (None: none of its own)."""
        if key is None or self.allow_list is None:
            return None
        return self.allow_list.max_priority(key.encode("ascii", "replace"))

    def check_bind(self, endpoint: str) -> None:
        """ValueError unless a stage may bind `endpoint`: ipc:// and loopback tcp always; a tcp
        address other hosts can reach only with keys or with `insecure_tcp`."""
        why = exposure(endpoint)
        if why is None or self.enabled:
            return
        if self.insecure_tcp:
            log.warning("binding %s without CURVE (%s): anyone who reaches it can send to this stage", endpoint, why)
            return
        raise ValueError(
            f"refusing to bind {endpoint}: {why}, and without keys anyone who reaches it could talk to "
            f"this stage. Give the service a key pair ({SECRET_KEY_ENV}=FILE.key_secret, made by "
            f"`nanovllm keygen DIR`), or pass --insecure-tcp ({INSECURE_TCP_ENV}=1) to accept unauthenticated, "
            "unencrypted traffic, or bind 127.0.0.1 or ipc:// instead")

    def server(self, sock: zmq.Socket) -> None:
        """Make a client-facing socket (the ROUTERs) a CURVE server: clients in the allow-list and
        the service itself may connect. Call before bind; a no-op without keys."""
        self._make_server(sock, CLIENT_DOMAIN)

    def pipeline_server(self, sock: zmq.Socket) -> None:
        """Make a stage-to-stage socket (the PULLs) a CURVE server that only the service's own
        key may reach: an allowed client cannot forge stage traffic. Call before bind."""
        self._make_server(sock, PIPELINE_DOMAIN)

    def client(self, sock: zmq.Socket) -> None:
        """Make a socket that connects to another stage (a PUSH) a CURVE client with the service's
        own key pair. Call before connect; a no-op without keys."""
        if self.keys is not None:
            client_socket_security(sock, self.keys, self.keys.public)

    def close(self) -> None:
        """Stop the authenticator (after this, handshakes on this context's CURVE servers fail)."""
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    def __enter__(self) -> ServiceSecurity:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_server(self, sock: zmq.Socket, domain: bytes) -> None:
        if self.keys is None:
            return
        _check_unused(sock)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain)
        # Fail closed: without this, libzmq lets every CURVE client in when no authenticator answers.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def _start_authenticator(self, keys: CurveKeys) -> ThreadAuthenticator:
        def is_client(key: bytes) -> bool:
            return key == keys.public or (self.allow_list is not None and key in self.allow_list.keys())

        authenticator = ThreadAuthenticator(self.ctx, log=log)
        authenticator.configure_curve_callback(CLIENT_DOMAIN.decode(), _KeyCheck("client", is_client))
        authenticator.configure_curve_callback(PIPELINE_DOMAIN.decode(),
                                               _KeyCheck("stage-to-stage", lambda key: key == keys.public))
        try:
            authenticator.start()
        except zmq.ZMQError as e:
            authenticator.stop()
            if e.errno == zmq.EADDRINUSE:
                raise RuntimeError("this zmq.Context already has an authenticator: create one ServiceSecurity "
                                   "per context and share it among the stages that use the context") from None
            raise
        return authenticator


def _check_unused(sock: zmq.Socket) -> None:
    # libzmq copies a socket's options at bind/connect: CURVE set later would silently not apply.
    if sock.getsockopt(zmq.LAST_ENDPOINT):
        raise RuntimeError("set up CURVE before the socket binds or connects: it is already bound or connected")


# ---------------------------------------------------------------------------------- clients

def client_socket_security(sock: zmq.Socket, client_keys: CurveKeys, server_public_key: bytes) -> None:
    """Make a socket a CURVE client of the service whose public key is given. Call before connect."""
    if not isinstance(server_public_key, bytes) or not _is_z85_key(server_public_key):
        raise ValueError("server_public_key must be a 40-byte z85 CURVE public key (see load_public_key)")
    _check_unused(sock)
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


def claimed_id(identity: bytes, key: str | None) -> bool:
    """Whether a frame under `identity` that CURVE authenticated as `key` comes from a key other
    than the one the id belongs to (`new_routing_id`). False without CURVE (`key` None)."""
    return key is not None and identity[:KEY_TAG_BYTES] != key_tag(key)


def show_client(identity: bytes) -> str:
    """A client's routing id as logs show it: its first half. A whole id, read from a log, would
    let whoever reads it claim the client's streams where that is possible (no CURVE)."""
    return identity[:KEY_TAG_BYTES].hex() + "~"


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


# ---------------------------------------------------------------------------------- nanovllm keygen

def _parse_owner(text: str) -> tuple[int, int]:
    """USER[:GROUP] (names, or numbers that need no entry) -> (uid, gid); the group defaults to
    the user's own (or, for a bare number without an entry, the same number)."""
    import grp
    import pwd

    user, _, group = text.partition(":")
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        uid, default_gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        if not user.isdigit():
            raise ValueError(f"--owner: no such user {user!r}") from None
        uid = default_gid = int(user)
    if not group:
        return uid, default_gid
    if group.isdigit():
        return uid, int(group)
    try:
        return uid, grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"--owner: no such group {group!r}") from None


def keygen_main(argv: list[str] | None = None) -> int:
    """`nanovllm keygen DIR [--name NAME] [--client]`: write a key pair and say where each file goes."""
    parser = argparse.ArgumentParser(
        prog="nanovllm keygen",
        description="Write a CURVE key pair (NAME.key public, NAME.key_secret secret) for a service or a client.",
        epilog=f"A service's stages read its secret key from {SECRET_KEY_ENV} and the allow-list directory of "
               f"client public keys from {CLIENTS_DIR_ENV}; a client reads its secret key from "
               f"{CLIENT_KEY_ENV} and the service's public key from {SERVER_KEY_ENV}. Without keys a stage binds "
               f"a non-loopback tcp address only with --insecure-tcp ({INSECURE_TCP_ENV}=1).")
    parser.add_argument("directory", help="where to write the files (created 0700 if missing)")
    parser.add_argument("--name", help="file name stem (default: server, or client with --client)")
    parser.add_argument("--client", action="store_true", help="a client's key pair (default: a service's)")
    parser.add_argument("--max-priority", type=int, metavar="N",
                        help="with --client: the highest priority the service gives this key's requests, written "
                             "into its public file (a ceiling below the service's --max-priority; a request above it "
                             "is refused)")
    parser.add_argument("--owner", metavar="USER[:GROUP]",
                        help="give the files (and the directory, if this makes it) to USER, e.g. the service's "
                             "user `nanovllm` when root writes its keys: a secret key must be readable by its "
                             "owner only, and the stages refuse one that others may read")
    args = parser.parse_args(argv)
    name = args.name or ("client" if args.client else "server")
    if args.max_priority is not None and not args.client:
        parser.error("--max-priority is a client key's ceiling: give --client too")
    try:
        owner = _parse_owner(args.owner) if args.owner else None
        made_directory = not os.path.isdir(args.directory)
        public_file, secret_file = generate_keypair(args.directory, name, args.max_priority)
        if owner is not None:
            for path in [public_file, secret_file] + ([args.directory] if made_directory else []):
                os.chown(path, *owner)
    except (OSError, ValueError) as e:
        print(f"nanovllm keygen: error: {e}", file=sys.stderr)
        return 1
    if args.client:
        print(f"wrote {secret_file}\n    secret: stays with this client; point {CLIENT_KEY_ENV} at it")
        print(f"wrote {public_file}\n    public: copy it into the service's allow-list directory ({CLIENTS_DIR_ENV}); "
              "it is admitted at its next connection, no restart needed")
    else:
        print(f"wrote {secret_file}\n    secret: stays with the service; point {SECRET_KEY_ENV} at it for all three stages")
        print(f"wrote {public_file}\n    public: give it to each client; clients point {SERVER_KEY_ENV} at it")
    return 0
