"""Unit: config precedence, sizes and one-line errors."""

import pytest

from k3d.config import ConfigError, parse_size, resolve


@pytest.mark.parametrize("text,want", [("512MiB", 512 * 2**20), ("8GiB", 8 * 2**30), ("4096", 4096),
                                       ("1.5G", 1_500_000_000), (" 2 mib ", 2 * 2**20), (1234, 1234)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "lots", "12XB", "-5MiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_precedence_cli_env_file_default(tmp_path):
    f = tmp_path / "k3d.toml"
    f.write_text('arena = "1GiB"\nreaders = 2\nsource = "/file"\nendpoint = "ipc:///tmp/file.sock"\n')
    env = {"K3D_READERS": "3", "K3D_SOURCE": "/env"}
    cfg = resolve({"source": "/cli", "readers": None}, env, str(f))
    assert cfg.source == "/cli" and cfg.readers == 3 and cfg.arena == 2**30
    assert cfg.endpoint == "ipc:///tmp/file.sock"
    assert resolve({}, {"K3D_ENDPOINT": "ipc:///tmp/e.sock"}, str(f)).endpoint == "ipc:///tmp/e.sock"
    assert resolve({}, {}).readers is None          # the daemon picks per read path
    assert resolve({"readers": "auto"}, {"K3D_READERS": "3"}).readers is None


def test_default_endpoint_uses_runtime_dir():
    assert resolve({}, {"XDG_RUNTIME_DIR": "/run/user/7"}).endpoint == "ipc:///run/user/7/k3d/k3d.sock"


def test_unknown_key_named(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("arenna = 5\n")
    with pytest.raises(ConfigError, match="unknown key 'arenna'"):
        resolve({}, {}, str(f))


def test_unparsable_file(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("arena = [\n")
    with pytest.raises(ConfigError, match="does not parse"):
        resolve({}, {}, str(f))


def test_bad_values_name_their_origin():
    with pytest.raises(ConfigError, match="environment K3D_READERS: bad value 'x' for readers"):
        resolve({}, {"K3D_READERS": "x"})
    with pytest.raises(ConfigError, match="--arena"):
        resolve({"arena": "big"}, {})


@pytest.mark.parametrize("ep,words", [
    ("tcp://127.0.0.1:99999", "port 99999 is out of range"),
    ("foo://x", "use ipc:///path/k3d.sock or tcp://host:port"),
    ("ipc://relative.sock", "absolute path"),
    ("ipc:///" + "a" * 120 + "/k.sock", "shorter directory"),
])
def test_bad_endpoints_are_refused_before_start(ep, words):
    with pytest.raises(ConfigError, match="--endpoint: bad value") as e:
        resolve({"endpoint": ep}, {})
    assert words in str(e.value)


def test_good_endpoints():
    for ep in ("ipc:///run/k3d/k3d.sock", "tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://localhost:1"):
        assert resolve({"endpoint": ep}, {}).endpoint == ep


def test_values_of_the_wrong_kind_are_refused(tmp_path):
    f = tmp_path / "k.toml"
    for text, words in [("readers = 4.7\n", "bad value 4.7 for readers: not an integer"),
                        ("lease_s = true\n", "bad value True for lease_s: not a number of seconds"),
                        ("lease_s = inf\n", "bad value inf for lease_s: must be a positive number"),
                        ("http_timeout = nan\n", "bad value nan for http_timeout")]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=words):
            resolve({}, {}, str(f))
    with pytest.raises(ConfigError, match="^--lease: bad value 0.0 for lease_s"):
        resolve({"lease_s": 0.0}, {})                      # the option as the CLI spells it
    f.write_bytes(b"\xff\xfe arena = 1\n")                 # not UTF-8
    with pytest.raises(ConfigError, match=f"config file {f} does not parse"):
        resolve({}, {}, str(f))


def test_cli_arena_beats_slots_from_file_or_env(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("slots = 10\n")
    assert resolve({"arena": "1GiB"}, {}, str(f)).slots == 0
    assert resolve({"arena": "1GiB"}, {"K3D_SLOTS": "7"}).slots == 0
    assert resolve({}, {}, str(f)).slots == 10                      # no --arena: the file's slots
    assert resolve({"arena": "1GiB", "slots": 3}, {}, str(f)).slots == 3


@pytest.mark.parametrize("value,ok", [("0", 0.0), ("2", 2.0), ("1.5", 1.5), ("0.5", None), ("inf", None),
                                      ("nan", None), ("true", None), ("-1", None)])
def test_max_share_is_off_or_a_factor_from_1(value, ok):
    if ok is None:
        with pytest.raises(ConfigError, match="max_share"):
            resolve({}, {"K3D_MAX_SHARE": value})
    else:
        assert resolve({}, {"K3D_MAX_SHARE": value}).max_share == ok
    assert resolve({}, {}).max_share == 2.0
