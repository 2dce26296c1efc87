"""CURVE security for the service's sockets: key files, socket setup, and who may connect.

One key pair per service instance (the "server" pair) is shared by its three stages: each stage's
bound sockets are CURVE servers with its secret key, and a stage's PUSH to another stage is a
CURVE client using that same pair. Each client has a pair of its own and is let in by putting its
public key file into the service's allow-list directory. A `zmq.auth` authenticator thread per
stage (per zmq.Context) answers the handshakes. Without keys nothing changes, except that a stage
refuses to bind a tcp address other hosts can reach unless told it may (`check_bind`).

Key files use the zmq certificate format (`zmq.auth.load_certificate` reads them). Imports only
pyzmq and the standard library: the client library uses it too.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

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

def generate_keypair(directory: str, name: str) -> tuple[str, str]:
    """Write `DIR/NAME.key` (public) and `DIR/NAME.key_secret` (secret, mode 0600); the directory
    is created 0700 if missing. Returns (public file, secret file). Never overwrites a key."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or not name.isprintable():
        raise ValueError(f"a key name must be a plain file name (no directories), got {name!r}")
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
        _write_new(public_file, _certificate(f"CURVE public key of {name!r}, made {now}.", public), 0o644)
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


def _certificate(comment: str, public: bytes, secret: bytes | None = None) -> str:
    lines = [f"#   {comment}", "#   ZeroMQ CURVE certificate, written by nanovllm keygen", "", "metadata",
             "curve", f'    public-key = "{public.decode()}"']
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


# ---------------------------------------------------------------------------------- authentication

class AllowList:
    """The client public keys in a directory of `*.key` files (other files are ignored).

    Re-read on every call: one directory scan, and a file is parsed again only when its size,
    mtime or inode changed. A key file added or removed takes effect at the next handshake; a
    connection already made stays. An unreadable or malformed file is skipped (logged once)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict[str, tuple[tuple[int, int, int, int], bytes | None]] = {}
        self._readable = True

    def keys(self) -> set[bytes]:
        try:
            entries = [e for e in os.scandir(self.directory) if e.name.endswith(PUBLIC_SUFFIX)]
        except OSError as e:
            if self._readable:  # logged when it breaks, not at every handshake
                log.warning("cannot read the client allow-list %s (%s): no client gets in", self.directory, e.strerror)
            self._files, self._readable = {}, False
            return set()
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
            try:
                if st.st_mode & 0o022:
                    raise KeyFileError(f"{entry.path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users "
                                       f"replace the key in it; chmod go-w {entry.path}")
                key = load_public_key(entry.path)
            except KeyFileError as e:
                log.warning("skipping a client key: %s", e)
                key = None
            files[entry.name] = (signature, key)
        self._files = files
        return {key for _, key in files.values() if key is not None}


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
    parser.add_argument("--owner", metavar="USER[:GROUP]",
                        help="give the files (and the directory, if this makes it) to USER, e.g. the service's "
                             "user `nanovllm` when root writes its keys: a secret key must be readable by its "
                             "owner only, and the stages refuse one that others may read")
    args = parser.parse_args(argv)
    name = args.name or ("client" if args.client else "server")
    try:
        owner = _parse_owner(args.owner) if args.owner else None
        made_directory = not os.path.isdir(args.directory)
        public_file, secret_file = generate_keypair(args.directory, name)
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
