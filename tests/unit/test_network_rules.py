"""Network edges, pure: which tcp endpoints ``resolve`` accepts, where ``--metrics`` binds
without a host, and how a client's name is escaped for logs and status."""

import pytest

from k3d.config import ConfigError, resolve
from k3d.observe.metrics import parse_hostport
from k3d.serve.access import printable


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://127.3.2.1:5555", "tcp://[::1]:5555",
                                      "tcp://localhost:5555", "ipc:///run/k3d/k3d.sock"])
def test_loopback_and_ipc_endpoints_are_accepted(endpoint):
    assert resolve({"endpoint": endpoint}, {}).endpoint == endpoint


@pytest.mark.parametrize("endpoint, host", [("tcp://0.0.0.0:5555", "0.0.0.0"), ("tcp://*:5555", "*"),
                                            ("tcp://10.1.2.3:5555", "10.1.2.3"), ("tcp://[::]:5555", "::"),
                                            ("tcp://eth0:5555", "eth0")])
def test_endpoints_beyond_loopback_are_refused_in_one_line(endpoint, host):
    with pytest.raises(ConfigError) as e:
        resolve({"endpoint": endpoint}, {})
    msg = str(e.value)
    assert "\n" not in msg and f"({host} is not a loopback address)" in msg
    assert "--allow-remote-tcp" in msg and "the arena is shared memory on this machine" in msg


def test_the_risk_is_accepted_only_explicitly(tmp_path):
    assert resolve({"endpoint": "tcp://0.0.0.0:5555", "allow_remote_tcp": True}, {}).allow_remote_tcp
    assert resolve({}, {"K3D_ENDPOINT": "tcp://0.0.0.0:5555", "K3D_ALLOW_REMOTE_TCP": "yes"}).allow_remote_tcp
    f = tmp_path / "k3d.toml"
    f.write_text('endpoint = "tcp://0.0.0.0:5555"\nallow_remote_tcp = true\n')
    assert resolve({}, {}, str(f)).endpoint == "tcp://0.0.0.0:5555"
    with pytest.raises(ConfigError, match="allow_remote_tcp.*use true or false"):
        resolve({}, {"K3D_ALLOW_REMOTE_TCP": "maybe"})


def test_metrics_without_a_host_binds_loopback():
    assert parse_hostport(":9484") == ("127.0.0.1", 9484)
    assert parse_hostport("0.0.0.0:9484") == ("0.0.0.0", 9484)      # a host given is the user's choice
    assert parse_hostport("[::1]:9484") == ("::1", 9484)


@pytest.mark.parametrize("name, shown", [
    ("worker-1", "worker-1"), ("José", "José"), ("a\\nb", "a\\nb"),
    ("evil\nk3d: WARNING forged", "evil\\nk3d: WARNING forged"),
    ("x\r\x1b[2J\x00\x7f", "x\\r\\x1b[2J\\x00\\x7f"), ("line\u2028sep\u0085", "line\\u2028sep\\x85"),
])
def test_client_names_are_escaped_to_one_printable_line(name, shown):
    assert printable(name) == shown
    assert printable(shown) == shown                  # k3ctl escapes again what a daemon sent: no change
    assert shown.isprintable()
