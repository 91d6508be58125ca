"""The documentation site builds strictly, and its generated reference has no holes.

``mkdocs build --strict`` (mkdocs.yml at the root, the Material theme, the ``docs``
extra) fails on any warning: a broken link or anchor, a page missing from the nav, a
generated page that does not render.  The reference pages for the command line, the
config keys, the metrics and the Python API are generated from the code at each build
by ``docs/hooks/reference.py`` with ``reference_pages.py``; these tests import the latter
by path and check what a generated page would leave blank: an option with no help text,
a config key with neither an option's help nor a comment beside its field, a metric or a
wire error that says nothing.
"""

import importlib.util
import os
import re
import subprocess
import sys

from helpers import ROOT


def _hook():
    path = os.path.join(ROOT, "docs", "hooks", "reference_pages.py")
    spec = importlib.util.spec_from_file_location("k3d_docs_pages", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_option_and_subcommand_has_help_text():
    missing = _hook().missing_help()
    assert not missing, f"options without help= (the CLI reference would show them blank): {', '.join(missing)}"


def test_every_config_key_is_documented():
    blank = [r["key"] for r in _hook().config_docs() if not r["doc"].strip()]
    assert not blank, (f"config keys with no documentation: {', '.join(blank)} (give the field a k3d start "
                       "option with help=, or a comment beside it in k3d/config.py)")


def test_every_start_option_appears_in_the_cli_reference():
    hook = _hook()
    page = hook.cli_page()
    start = {name: sub for name, _help, sub in hook._subcommands(hook.parsers()["k3d"])}["start"]
    flags = [s for a in hook.options(start) for s in a.option_strings]
    assert "--source" in flags and "--arena" in flags
    absent = [f for f in flags if f"`{f}`" not in page]
    assert not absent, f"k3d start options missing from reference/cli.md: {absent}"


def test_every_metric_has_help_text():
    families = _hook().metric_families()
    names = {name for name, *_ in families}
    assert {"k3d_hits_total", "k3d_fetch_seconds", "k3d_ready", "k3d_origin_up"} <= names
    assert not [name for name, _kind, doc, _labels in families if not doc.strip()]


def test_every_wire_error_says_what_it_means():
    """The protocol reference's error table is the classes' own docstrings."""
    from k3client import errors
    blank = [cls.__name__ for cls in set(errors._BY_CODE.values()) if not (cls.__dict__.get("__doc__") or "").strip()]
    assert not blank, f"error classes without a docstring (the reference would say nothing): {sorted(blank)}"


def _anchors(path):
    """GitHub's anchors for the headings of a Markdown file (lowercase, punctuation dropped)."""
    with open(path, encoding="utf-8") as f:
        heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", f.read(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _local_links(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", f.read())
    return [(path, anchor) for path, anchor in links if "://" not in path]


def test_root_files_link_to_pages_that_exist():
    """The README, SECURITY.md and CHANGELOG.md lead into docs/ as GitHub shows them (the
    strict build checks the site's own links).  The generated reference pages are not files
    of the checkout, so a link to one would be broken there."""
    assert ("docs/guides/vllm.md", "") in _local_links("README.md"), "the README must lead to the vLLM guide"
    for name in ("README.md", "SECURITY.md", "CHANGELOG.md"):
        for path, anchor in _local_links(name):
            full = os.path.join(ROOT, path)
            assert os.path.exists(full), f"{name} links to {path}, which is not a file of the checkout"
            if anchor:
                assert anchor in _anchors(full), f"{name} links to {path}#{anchor}: no such heading"


def test_strict_build_has_no_warning(tmp_path):
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"), \
        "mkdocs or its Material theme is missing: pip install -e '.[docs]'"
    env = {**os.environ, "PYTHONPATH": ROOT, "NO_MKDOCS_2_WARNING": "1"}
    # no --quiet: it raises the log level past WARNING, and strict mode counts the warnings it logs
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "--config-file", os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}{r.stderr}"
    assert "WARNING" not in r.stderr, r.stderr
    for page in ("index.html", "reference/cli/index.html", "reference/config/index.html",
                 "reference/metrics/index.html", "guides/vllm/index.html"):
        assert (tmp_path / "site" / page).is_file(), f"{page} was not built"
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--pin-quota" in cli and "k3ctl status" in cli
