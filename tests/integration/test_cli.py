"""Integration: what a person typing ``k3d`` / ``k3ctl`` sees (help, errors, the live view)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import ctrl_c_reaches_it, run_module as run
from k3d.demo.synthetic import write_checkpoint


@pytest.mark.parametrize("argv, usage", [
    (["start", "--arnea", "4MiB"], "usage: k3d start"),
    (["demo", "--tokns", "3"], "usage: k3d demo"),
])
def test_misspelled_flag_shows_the_subcommands_usage(argv, usage):
    r = run("k3d", *argv)
    assert r.returncode == 2 and r.stderr.startswith(usage) and "unrecognized arguments" in r.stderr


def test_k3ctl_misspelled_flag_shows_status_usage():
    r = run("k3d.commands.ctl", "status", "--jsn")
    assert r.returncode == 2 and r.stderr.startswith("usage: k3ctl status")


@pytest.mark.parametrize("opt, value", [("--tokens", "0"), ("--clients", "0"), ("--tokens", "-5"),
                                        ("--clients", "-1")])
def test_demo_refuses_nothing_to_check(opt, value):
    r = run("k3d", "demo", opt, value)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and f"{opt} {value}: use 1 to" in r.stderr
    assert "OK" not in r.stdout


def test_install_unit_refuses_a_missing_config(tmp_path):
    r = run("k3d", "install-unit", "--print", "--config", str(tmp_path / "nope.toml"))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr


def test_start_warns_about_an_arena_smaller_than_a_token(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--slots", "2")
    assert "one token pins 4 (4 layers x top-1 at least)" in d.log()


def test_tensor_without_torch_says_how_to_install(checkpoint, start_daemon):
    d = start_daemon(checkpoint, "--arena", "4MiB")
    code = ("import sys; sys.modules['torch'] = None\n"
            "import k3client\n"
            f"c = k3client.connect({d.endpoint!r})\n"
            "ex = c.fetch(0, [0])[0]\n"
            "try:\n    ex.tensor(c.layout[0].name)\nexcept ImportError as e:\n    print(e)\n"
            "print(ex.array(c.layout[0].name).dtype)\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "needs torch: pip install torch --index-url https://download.pytorch.org/whl/cpu" in r.stdout


def test_status_json_failure_is_json(tmp_path):
    r = run("k3d.commands.ctl", "status", "--json", "--endpoint", f"ipc://{tmp_path}/k.sock")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["ok"] is False and "not running" in out["error"]


def test_watch_prints_frames_with_interval_rates(checkpoint, start_daemon):
    import k3client
    d = start_daemon(checkpoint, "--arena", "4MiB")
    p = subprocess.Popen([sys.executable, "-m", "k3d.commands.ctl", "status", "--watch", "0.3",
                          "--endpoint", d.endpoint],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
    try:
        with k3client.connect(d.endpoint, name="w") as c:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                c.begin_token()
                c.fetch(0, [0, 1])
                time.sleep(0.05)
                if time.monotonic() > deadline - 28:
                    break
            time.sleep(1.0)
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    frames = [f for f in out.split("\n\n") if f.strip()]
    assert len(frames) >= 3
    assert all("hit rate" in f and "since start: hit rate" in f for f in frames)
    assert any("last 0.3s: hit rate" in f for f in frames[1:])
    assert "\x1b[" not in out          # not a terminal: no redraw codes in a log


def test_watch_json_is_one_object_per_line(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "k3d.commands.ctl", "status", "--watch", "0.2", "--json",
                          "--endpoint", f"ipc://{tmp_path}/k.sock"], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ), preexec_fn=ctrl_c_reaches_it)
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(lines) >= 2 and all(x["ok"] is False for x in lines)


def test_small_experts_sizes_show_and_paste_back(start_daemon, tmp_path):
    """Experts of a few KiB: the start-up advice and k3ctl status name sizes in KiB, and the
    --arena the advice gives, pasted back, is enough."""
    ckpt = write_checkpoint(str(tmp_path / "tiny"), layers=2, experts=8, hidden=32, inter=16)
    d = start_daemon(ckpt, "--slots", "100")                     # 16 experts: far more than the model has
    whole = re.search(r"--slots 16 \(--arena (\S+)\) holds all of it", d.log())
    assert whole and whole.group(1) == "64KiB", d.log()
    status = run("k3d.commands.ctl", "status", "--endpoint", d.endpoint)
    assert re.search(r"arena   400KiB: 100 slots x 4KiB", status.stdout), status.stdout
    assert d.stop() == 0
    d = start_daemon(ckpt, "--slots", "1")                       # under one token's pins (2 layers x top-1)
    low = re.search(r"raise --arena to at least (\S+) \(--slots 2\)", d.log())
    assert low and low.group(1) == "8KiB", d.log()
    assert d.stop() == 0
    for arena, slots in ((whole.group(1), 16), (low.group(1), 2)):
        d = start_daemon(ckpt, "--arena", arena)
        assert f"slots={slots} " in d.log() and "warning" not in d.log(), d.log()
        assert d.stop() == 0
