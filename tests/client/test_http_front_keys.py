"""Which CURVE keys the HTTP front connects with (`nanovllm_client.http.__main__.curve_key_files`):
its own where given; else, beside a service that names its key in $NANOVLLM_CURVE_SECRET_KEY (its
systemd unit reads the instance's env file, as the stages' units do), the service's own pair, as
`nanovllm serve` hands it over; else none (ipc, or a loopback service's instance key later)."""
from __future__ import annotations

import pytest

pytest.importorskip("zmq")

from nanovllm_client.http.__main__ import curve_key_files, parser  # noqa: E402
from nanovllm_client.security import (CLIENT_KEY_ENV, SERVER_KEY_ENV, SERVICE_KEY_ENV,  # noqa: E402
                                      client_keys_from_env, generate_keypair, load_keypair, load_public_key,
                                      service_pair_env)


@pytest.fixture
def keys(tmp_path):
    service_public, service_secret = generate_keypair(str(tmp_path / "service"), "service")
    _, own_secret = generate_keypair(str(tmp_path / "front"), "front")
    return service_public, service_secret, own_secret


def front_keys(monkeypatch, environ: dict[str, str], argv: list[str] | None = None):
    for name in (CLIENT_KEY_ENV, SERVER_KEY_ENV, SERVICE_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = parser().parse_args(argv or [])
    return client_keys_from_env(curve_key_files(args, environ))


def test_the_services_key_in_the_environment_gives_the_services_own_pair(keys, monkeypatch):
    service_public, service_secret, _ = keys
    pair, server = front_keys(monkeypatch, {SERVICE_KEY_ENV: service_secret})
    assert pair == load_keypair(service_secret) and server == load_public_key(service_public)
    # What `nanovllm serve` hands its front comes to the same keys.
    assert front_keys(monkeypatch, {SERVICE_KEY_ENV: service_secret, **service_pair_env(service_secret)}) == (
        pair, server)


def test_the_fronts_own_keys_win_and_without_any_there_are_none(keys, monkeypatch):
    service_public, service_secret, own_secret = keys
    own = {CLIENT_KEY_ENV: own_secret, SERVER_KEY_ENV: service_public}
    assert front_keys(monkeypatch, {SERVICE_KEY_ENV: service_secret, **own})[0] == load_keypair(own_secret)
    flags = ["--curve-client-key", own_secret, "--curve-server-key", service_public]
    assert front_keys(monkeypatch, {SERVICE_KEY_ENV: service_secret}, flags)[0] == load_keypair(own_secret)
    assert front_keys(monkeypatch, {}) is None
    with pytest.raises(ValueError, match=SERVER_KEY_ENV):  # half a pair of its own is an error, not the service's
        front_keys(monkeypatch, {SERVICE_KEY_ENV: service_secret}, ["--curve-client-key", own_secret])
