"""Another user on the host gets nothing from the runtime directory: not a file of ours written
through its links, not a prompt sent to its sockets, not a forged notification believed.

With XDG_RUNTIME_DIR unset (sudo, cron, containers) the default directory is
$TMPDIR/nanovllm-UID, in a place every user can write: another user can make it first. These
tests make it as a second uid (tests/helpers/other_user.py) in a sticky, world-writable folder
standing in for /tmp, and check what the service, its stages and its clients then do.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import types

import pytest

from nanovllm_client import Client, UnsafeRuntimeDirError
from nanovllm_client.endpoints import check_ipc_endpoint, ensure_private_dir
from tests.helpers.other_user import OTHER_UID, as_other_user

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAKE_DIR = r"""
import os, sys
path, kind, target = sys.argv[1:4]
if kind == "symlink":
    os.mkdir(path + ".real", 0o777)
    os.chmod(path + ".real", 0o777)
    os.symlink(path + ".real", path)
    path += ".real"
else:
    os.mkdir(path, 0o777 if kind == "open" else 0o700)
    os.chmod(path, 0o777 if kind == "open" else 0o700)
for name in ("stages.json", "stages.json.tmp"):
    os.symlink(target, os.path.join(path, name))
"""

LISTEN = r"""
import os, select, socket, sys
path = sys.argv[1]
os.mkdir(path)
os.chmod(path, 0o777)
listeners = []
for name in ("tokenizer", "stream", "engine", "detok", "control"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(path, name + ".sock"))
    s.listen(16)
    listeners.append(s)
print("listening", flush=True)
accepted = received = 0
while True:
    ready, _, _ = select.select(listeners + [sys.stdin], [], [], 0.5)
    if sys.stdin in ready:
        break
    for s in ready:
        conn, _ = s.accept()
        accepted += 1
        conn.settimeout(1)
        try:
            received += len(conn.recv(65536))
        except OSError:
            pass
print(accepted, received, flush=True)
"""


@pytest.fixture
def shared_tmp():
    """A sticky folder every user may write in, as /tmp is; removed with what others left in it."""
    from tests.conftest import session_tmpdir

    path = tempfile.mkdtemp(prefix="shared-", dir=session_tmpdir())
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def default_dir_env(shared_tmp: str) -> dict[str, str]:
    """The environment of a user whose runtime directory is the shared fallback."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_RUNTIME_DIR", "NANOVLLM_RUNTIME_DIR", "NANOVLLM_URL")}
    env.update(TMPDIR=shared_tmp, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    return env


@pytest.mark.parametrize("kind", ["open", "private", "symlink"])
def test_nanovllm_serve_refuses_a_runtime_directory_another_user_made(other_user, shared_tmp, tmp_path, kind):
    target = tmp_path / "root-only"
    target.write_text("root's own file\n")
    target.chmod(0o600)
    before = target.stat()
    runtime_dir = os.path.join(shared_tmp, f"nanovllm-{os.geteuid()}")
    as_other_user(MAKE_DIR, runtime_dir, kind, str(target))
    run = subprocess.run([sys.executable, "-m", "nanovllm.supervisor", "--log-level", "INFO"], cwd=REPO,
                         env=default_dir_env(shared_tmp), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert f"runtime directory {runtime_dir}" in run.stderr
    assert ("symbolic link" if kind == "symlink" else f"uid {OTHER_UID}") in run.stderr
    assert "rm -r" in run.stderr  # the fix
    assert target.read_text() == "root's own file\n"
    assert target.stat().st_mtime_ns == before.st_mtime_ns and stat.S_IMODE(target.stat().st_mode) == 0o600


def test_a_stage_refuses_to_bind_in_another_users_directory(other_user, shared_tmp, tmp_path):
    runtime_dir = os.path.join(shared_tmp, "svc")
    as_other_user(MAKE_DIR, runtime_dir, "open", str(tmp_path / "nothing"))
    run = subprocess.run([sys.executable, "-m", "detok_proc", "--url", f"ipc://{runtime_dir}"], cwd=REPO,
                         env=default_dir_env(shared_tmp), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert f"runtime directory {runtime_dir} belongs to" in run.stderr and f"uid {OTHER_UID}" in run.stderr
    assert not any(name.endswith(".sock") for name in os.listdir(runtime_dir))


def test_a_client_never_connects_to_another_users_sockets(other_user, shared_tmp):
    runtime_dir = os.path.join(shared_tmp, f"nanovllm-{os.geteuid()}")
    listener = as_other_user(LISTEN, runtime_dir, wait=False)
    try:
        assert listener.stdout.readline().strip() == "listening", listener.stderr.read()
        cli = subprocess.run([sys.executable, "-m", "nanovllm_client.cli", "--connect-timeout", "5",
                              "my secret prompt"], cwd=REPO, env=default_dir_env(shared_tmp),
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1, (cli.stdout, cli.stderr)
        assert f"runtime directory {runtime_dir} belongs to" in cli.stderr and f"uid {OTHER_UID}" in cli.stderr
        assert cli.stdout == ""
        with pytest.raises(UnsafeRuntimeDirError, match="lies where other users can make directories"):
            Client(f"ipc://{runtime_dir}", connect_timeout=5)
        time.sleep(1)  # what a connection would have sent has arrived by now
    finally:
        out, err = listener.communicate(input="", timeout=60)
    accepted, received = map(int, out.split())
    assert (accepted, received) == (0, 0), err


def test_a_client_makes_a_missing_directory_in_a_shared_place_its_own(shared_tmp):
    # Before the service starts, no one else may make the directory the client waits on.
    runtime_dir = os.path.join(shared_tmp, "not-yet")
    check_ipc_endpoint(f"ipc://{runtime_dir}/tokenizer.sock")
    info = os.lstat(runtime_dir)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    ensure_private_dir(runtime_dir)  # the service, as the same user, then takes it


def test_a_service_users_directory_made_by_root_is_trusted_by_other_clients(tmp_path):
    # systemd's RuntimeDirectory: /run (root's) / nanovllm / NAME, owned by the service user.
    if os.geteuid() != 0:
        pytest.skip("needs root, to give a directory to another uid")
    parent = tmp_path / "run"
    parent.mkdir(mode=0o755)
    service_dir = parent / "main"
    service_dir.mkdir(mode=0o700)
    os.chown(service_dir, OTHER_UID, OTHER_UID)
    check_ipc_endpoint(f"ipc://{service_dir}/tokenizer.sock")  # root's `nanovllm health` may connect
    service_dir.chmod(0o777)
    with pytest.raises(UnsafeRuntimeDirError, match="mode 0777"):
        check_ipc_endpoint(f"ipc://{service_dir}/tokenizer.sock")
    service_dir.chmod(0o700)
    parent.chmod(0o1777)  # a shared place: anyone could have made it
    with pytest.raises(UnsafeRuntimeDirError, match="lies where other users can make directories"):
        check_ipc_endpoint(f"ipc://{service_dir}/tokenizer.sock")


def test_this_users_own_directory_must_be_private(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    for check in (ensure_private_dir, lambda d: check_ipc_endpoint(f"ipc://{d}/x.sock")):
        with pytest.raises(UnsafeRuntimeDirError, match=f"runtime directory {loose} has mode 0755.*chmod 700"):
            check(str(loose))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(UnsafeRuntimeDirError, match="is a symbolic link"):
        ensure_private_dir(str(link))
    fresh = tmp_path / "a" / "b"
    ensure_private_dir(str(fresh))
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700


def test_the_supervisor_writes_its_state_without_following_links(tmp_path):
    from nanovllm.supervisor import Supervisor

    runtime_dir = tmp_path / "rt"
    ensure_private_dir(str(runtime_dir))
    target = tmp_path / "victim"
    target.write_text("untouched")
    (runtime_dir / "stages.json.tmp").symlink_to(target)
    supervisor = Supervisor(f"ipc://{runtime_dir}", "default", str(runtime_dir), [], "INFO")
    try:
        supervisor.write_state()
        (runtime_dir / "stages.json").unlink()
        (runtime_dir / "stages.json").symlink_to(target)
        supervisor.write_state()
    finally:
        for stage in supervisor.stages.values():
            stage.notify.close()
    assert target.read_text() == "untouched"
    assert not os.path.islink(runtime_dir / "stages.json")
    assert json.loads((runtime_dir / "stages.json").read_text())["url"] == f"ipc://{runtime_dir}"
    assert sorted(os.listdir(runtime_dir)) == ["stages.json", "stages.json.tmp"]  # no temporary file left


def test_the_supervisor_believes_only_the_stages_own_notifications(tmp_path):
    from nanovllm.supervisor import Supervisor

    supervisor = Supervisor("ipc:///nonexistent", "default", str(tmp_path), [], "INFO")
    stage = supervisor.stages["engine_proc"]
    address = "\0" + stage.notify_name[1:]
    code = f"import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'READY=1', {address!r})"
    try:
        # Any local user can send to an abstract socket name; here another process than the stage.
        forger = subprocess.run([sys.executable, "-c", code], timeout=60, check=True)
        stage.proc = types.SimpleNamespace(pid=os.getpid())
        supervisor.read_notifications()
        assert not stage.ready, f"a forged READY=1 (from {forger}) was believed"
        genuine = subprocess.Popen([sys.executable, "-c", code])  # the stage, notifying as sd_notify does
        stage.proc = types.SimpleNamespace(pid=genuine.pid)
        assert genuine.wait(timeout=60) == 0
        supervisor.read_notifications()
        assert stage.ready
    finally:
        for s in supervisor.stages.values():
            s.notify.close()
