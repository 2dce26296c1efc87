"""CURVE for the service's stages: socket setup, the authenticator thread, the client allow-list,
per-key claims on routing ids, and `nanovllm keygen`.

One key pair per service instance (the "server" pair) is shared by its three stages: each stage's
bound sockets are CURVE servers with its secret key, and a stage's PUSH to another stage is a
CURVE client using that same pair. Each client has a pair of its own and is let in by putting its
public key file into the service's allow-list directory. A `zmq.auth` authenticator thread per
stage (per zmq.Context) answers the handshakes. Without keys of its own a loopback tcp service
uses its instance key (`nanovllm_client.security`, which also reads and writes the key files);
a stage refuses to bind a tcp address other hosts can reach without keys unless told it may
(`check_bind`).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import stat
import sys
from collections.abc import Callable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from nanovllm_client.security import (CLIENT_KEY_ENV, INSECURE_TCP_ENV, KEY_TAG_BYTES, MAX_KEY_FILE_BYTES,
                                      MAX_PRIORITY_FIELD, PUBLIC_SUFFIX, SERVER_KEY_ENV, SERVICE_KEY_ENV, CurveKeys,
                                      KeyFileError, check_unused, client_socket_security, exposure,
                                      generate_keypair, key_tag, load_keypair, load_public_key)

SECRET_KEY_ENV = SERVICE_KEY_ENV
"""A stage's service secret key file (`NAME.key_secret`); the HTTP front beside the service reads
the same variable (nanovllm_client.security)."""
CLIENTS_DIR_ENV = "NANOVLLM_CURVE_CLIENTS"
"""A stage's allow-list: a directory of client public key files (`*.key`)."""

log = logging.getLogger("nanovllm.security")

CLIENT_DOMAIN = b"nanovllm.clients"
"""ZAP domain of client-facing sockets: the service's own key and the allow-list get in."""
PIPELINE_DOMAIN = b"nanovllm.pipeline"
"""ZAP domain of stage-to-stage sockets: only the service's own key gets in."""

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
        check_unused(sock)
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



def claimed_id(identity: bytes, key: str | None) -> bool:
    """Whether a frame under `identity` that CURVE authenticated as `key` comes from a key other
    than the one the id belongs to (`new_routing_id`). False without CURVE (`key` None)."""
    return key is not None and identity[:KEY_TAG_BYTES] != key_tag(key)


def show_client(identity: bytes) -> str:
    """A client's routing id as logs show it: its first half. A whole id, read from a log, would
    let whoever reads it claim the client's streams where that is possible (no CURVE)."""
    return identity[:KEY_TAG_BYTES].hex() + "~"



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

