"""``k3client.vllm.broken_deps``: a package that cannot be imported is named with its error's
last line; one that imports, or is not installed, is not."""

from k3client.vllm import broken_deps


def _package(root, name: str, body: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)


def test_a_package_that_fails_to_load_is_named_with_its_error(tmp_path, monkeypatch):
    _package(tmp_path, "k3d_fake_ok", "x = 1\n")
    _package(tmp_path, "k3d_fake_bad", "raise OSError('Could not load this library: libfake_cuda.so')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    assert broken_deps.load_error("k3d_fake_ok", env=env) is None
    assert broken_deps.load_error("k3d_fake_bad", env=env) == "OSError: Could not load this library: libfake_cuda.so"
    monkeypatch.setattr(broken_deps, "installed", lambda name: name != "k3d_fake_absent")
    got = broken_deps.broken(("k3d_fake_ok", "k3d_fake_bad", "k3d_fake_absent"), env=env)
    assert got == {"k3d_fake_bad": "OSError: Could not load this library: libfake_cuda.so"}


def test_only_vllms_media_packages_are_ever_removed():
    assert broken_deps.PACKAGES == ("torchvision", "torchaudio", "torchcodec")
    assert broken_deps.installed("pytest") and not broken_deps.installed("k3d-fake-absent-dist")


def test_a_folder_of_the_same_name_in_the_current_directory_is_not_the_package(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    (tmp_path / "here").mkdir()
    _package(tmp_path / "site", "k3d_fake_pkg", "x = 1\n")
    _package(tmp_path / "here", "k3d_fake_pkg", "raise OSError('the folder in the current directory')\n")
    monkeypatch.chdir(tmp_path / "here")
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}
    assert broken_deps.load_error("k3d_fake_pkg", env=env) is None
