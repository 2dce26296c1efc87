"""A loopback tcp service given no keys runs CURVE with an instance key of its own: made once in the
private runtime directory, shared by its stages, found there by this user's clients; routing ids
under CURVE name their key, so another key's claim of one is refused; an allow-list file may set
its key's priority ceiling."""
from __future__ import annotations

import os
import stat
import threading

import pytest
import zmq

from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.security import (KeyFileError, client_curve, ensure_instance_key, generate_keypair,
                                      instance_key_file, instance_keys, load_keypair, new_routing_id)
from nanovllm.service.security import (AllowList, ServiceSecurity, claimed_id, keygen_main, read_max_priority,
                                       show_client)
from nanovllm.service.stage import service_secret_key

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
URL = "tcp://127.0.0.1:5550"


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    path = tmp_path / "run"
    monkeypatch.setenv("NANOVLLM_RUNTIME_DIR", str(path))
    for name in ("NANOVLLM_CURVE_CLIENT_KEY", "NANOVLLM_CURVE_SERVER_KEY"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_the_stages_of_one_service_make_and_share_one_instance_key(runtime_dir):
    made: list[str] = []
    threads = [threading.Thread(target=lambda: made.append(ensure_instance_key(URL))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 1 and made[0] == instance_key_file(URL)
    assert {load_keypair(path).public for path in made} == {load_keypair(made[0]).public}  # one pair, not eight
    assert stat.S_IMODE(os.stat(made[0]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    assert os.listdir(runtime_dir) == [os.path.basename(made[0])]  # no scratch left behind
    assert instance_key_file("tcp://127.0.0.1:5560") != made[0]  # another service, another key


def test_this_users_clients_share_the_instance_key_whoever_comes_first(runtime_dir):
    keys, public = client_curve(URL)  # a client before its service: it makes the pair
    assert public == keys.public and load_keypair(ensure_instance_key(URL)) == keys  # the stages take it
    assert client_curve(URL) == (keys, keys.public) == instance_keys(URL)
    assert client_curve(f"ipc://{runtime_dir}") is None  # a private directory needs no key
    assert client_curve("tcp://10.1.2.3:5550") is None  # elsewhere: keys of its own, or none at all
    assert client_curve(URL, environ={"NANOVLLM_INSECURE_TCP": "1"}) is None  # a service run --insecure-tcp
    given = (keys, b"x" * 40)
    assert client_curve(URL, given) is given  # what the caller gives wins


def test_a_loopback_tcp_service_without_keys_uses_its_instance_key(runtime_dir):
    loopback = service_endpoints(URL)
    assert service_secret_key(URL, loopback, None, insecure_tcp=False) == instance_key_file(URL)
    assert service_secret_key(URL, loopback, "/etc/nanovllm/keys/server.key_secret", False) == \
        "/etc/nanovllm/keys/server.key_secret"  # its own keys win
    assert service_secret_key(f"ipc://{runtime_dir}/svc", service_endpoints(f"ipc://{runtime_dir}/svc"),
                              None, False) is None  # a private directory needs no key
    wide = "tcp://0.0.0.0:5550"
    assert service_secret_key(wide, service_endpoints(wide), None, False) is None  # check_bind refuses it
    assert service_secret_key(URL, loopback, None, insecure_tcp=True) is None


def test_an_instance_key_in_another_users_reach_is_not_used(runtime_dir):
    ensure_instance_key(URL)
    os.chmod(runtime_dir, 0o777)
    with pytest.raises(PermissionError, match="other users may use it"):
        client_curve(URL)


def test_a_routing_id_names_its_key_and_another_keys_claim_is_seen(tmp_path):
    alice = load_keypair(generate_keypair(str(tmp_path), "alice")[1])
    bob = load_keypair(generate_keypair(str(tmp_path), "bob")[1])
    mine = new_routing_id((alice, alice.public))
    assert len(mine) == 16 and mine != new_routing_id((alice, alice.public))
    assert not claimed_id(mine, alice.public.decode())
    assert claimed_id(mine, bob.public.decode())
    assert not claimed_id(mine, None)  # without CURVE no key to compare
    assert len(new_routing_id(None)) == 16
    assert show_client(mine) == mine[:8].hex() + "~"  # logs show half an id: it cannot be claimed from a log


def test_an_allow_list_file_carries_its_keys_priority_ceiling(tmp_path, capsys):
    allowed = tmp_path / "allowed"
    assert keygen_main([str(tmp_path / "bob"), "--client", "--name", "bob", "--max-priority", "-3"]) == 0
    assert keygen_main([str(tmp_path / "carol"), "--client", "--name", "carol"]) == 0
    allowed.mkdir()
    for name in ("bob", "carol"):
        os.replace(tmp_path / name / f"{name}.key", allowed / f"{name}.key")
    assert read_max_priority(str(allowed / "bob.key")) == -3 and read_max_priority(str(allowed / "carol.key")) is None
    bob, carol = (load_keypair(str(tmp_path / n / f"{n}.key_secret")).public for n in ("bob", "carol"))
    entries = AllowList(str(allowed)).entries()
    assert entries == {bob: -3, carol: None}
    with pytest.raises(SystemExit):  # a ceiling is a client key's
        keygen_main([str(tmp_path / "svc"), "--max-priority", "1"])
    capsys.readouterr()


@pytest.mark.parametrize("value", ["high", "99999999999", "1.5"])
def test_a_bad_ceiling_skips_the_key_instead_of_admitting_it_without_one(tmp_path, value, caplog):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    public, _ = generate_keypair(str(tmp_path / "k"), "k", max_priority=1)
    text = open(public).read().replace('max-priority = "1"', f'max-priority = "{value}"')
    (allowed / "k.key").write_text(text)
    with pytest.raises(KeyFileError, match="max-priority must be a 32-bit integer"):
        read_max_priority(str(allowed / "k.key"))
    assert AllowList(str(allowed)).entries() == {}
    assert "skipping a client key" in caplog.text


def test_the_services_own_key_counts_clients_by_routing_id(tmp_path):
    ctx = zmq.Context()
    try:
        service = load_keypair(generate_keypair(str(tmp_path / "s"), "service")[1])
        bob_public, _ = generate_keypair(str(tmp_path / "b"), "bob", max_priority=2)
        os.makedirs(tmp_path / "allowed")
        os.replace(bob_public, tmp_path / "allowed" / "bob.key")
        bob = open(tmp_path / "allowed" / "bob.key").read().split('public-key = "')[1][:40]
        with ServiceSecurity(ctx, service, str(tmp_path / "allowed")) as security:
            assert security.tenant_key(service.public.decode()) is None  # its stages and same-user clients
            assert security.tenant_key(bob) == bob and security.tenant_key(None) is None
            assert security.max_priority_of(bob) == 2 and security.max_priority_of(None) is None
    finally:
        ctx.destroy(linger=0)
