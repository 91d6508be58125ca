"""MkDocs hook: the pages and passages of the site that come from the code.

- ``on_files`` adds the generated reference pages (``reference_pages``: ``reference/cli.md``,
  ``config.md``, ``metrics.md``, ``python-api.md``) and two pages that are files at the
  repository's root (``CHANGELOG.md``, ``SECURITY.md``, their ``docs/`` links made relative
  to the site).  Nothing is written into the checkout.
- ``on_page_markdown`` replaces markers in hand-written pages:
  ``<!-- k3d:errors -->`` (the wire error codes, from ``k3client.errors``),
  ``<!-- k3d:stats -->`` (status ``stats``, from ``k3d.observe.stats.Counters`` and the
  metrics' help), ``<!-- k3d:ops -->`` (each op's spec: the docstrings of the ``op_*``
  handlers in ``k3d.serve.ops``), ``<!-- k3d:docstring MODULE -->`` (a module's docstring,
  as written: the design pages' proofs live there, and the page shows the current text).

mkdocs loads this file with its directory on ``sys.path``, which is how ``reference_pages``
imports.  Runs in the mkdocs process, one thread.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re

from reference_pages import GENERATED, ROOT, _cell, _field_comments, _import_checkout


def errors_table() -> str:
    _import_checkout()
    errors = importlib.import_module("k3client.errors")
    k3client = importlib.import_module("k3client")
    rows = ["| code | exception | exported by `k3client` | meaning |", "|---|---|---|---|"]
    seen = set()
    for code, cls in errors._BY_CODE.items():
        if cls in seen:
            continue
        seen.add(cls)
        doc = _cell(inspect.cleandoc(cls.__dict__.get("__doc__") or ""))
        exported = "yes" if cls.__name__ in k3client.__all__ else "no"
        rows.append(f"| `{code}` | `{cls.__name__}` | {exported} | {doc} |")
    return "\n".join(rows)


def stats_table() -> str:
    _import_checkout()
    stats = importlib.import_module("k3d.observe.stats")
    metrics = importlib.import_module("k3d.observe.metrics")
    rows = ["| field | meaning |", "|---|---|"]
    names = [f.name for f in dataclasses.fields(stats.Counters)] + \
        [k for k in metrics.HELP if k not in {f.name for f in dataclasses.fields(stats.Counters)}]
    comments = _field_comments(stats.Counters)
    for name in names:
        rows.append(f"| `{name}` | {_cell(metrics.HELP.get(name) or comments.get(name, ''))} |")
    return "\n".join(rows)


def ops_section() -> str:
    """Each op's spec: the docstring of its ``op_*`` handler in ``k3d.serve.ops``."""
    _import_checkout()
    ops = importlib.import_module("k3d.serve.ops")
    out = []
    for _name, cls in inspect.getmembers(ops, inspect.isclass):
        if cls.__module__ != ops.__name__:
            continue
        for name, fn in vars(cls).items():
            if name.startswith("op_") and inspect.isfunction(fn):
                doc = inspect.cleandoc(fn.__doc__ or "")
                first, _, rest = doc.partition("\n")
                out += [f"### `{name[3:]}`", "", f"`{first.strip()}`" if first else "", "", rest.strip(), ""]
    return "\n".join(out)


def _markdown_of(text: str) -> str:
    """A docstring as Markdown: a list or a ``::`` literal block gets the blank line before
    it that Markdown needs (reST's ``::`` becomes ``:``)."""
    out: list[str] = []
    for line in text.splitlines():
        prev = out[-1] if out else ""
        if line.startswith("- ") and prev.strip() and not prev.startswith(("- ", " ")):
            out.append("")
        if line.startswith("    ") and prev.strip() and not prev.startswith(" "):
            out.append("")                      # the indented block after "...::" is code
        out.append(line)
    return "\n".join(out).replace("::\n", ":\n")


def docstring(module: str) -> str:
    _import_checkout()
    text = _markdown_of(inspect.cleandoc(importlib.import_module(module).__doc__ or ""))
    body = "\n".join("    " + line if line else "" for line in text.splitlines())
    return f'??? quote "The docstring of `{module}`"\n\n{body}\n'


# Pages of the site that are files at the repository's root (where users look for them), with
# their links into docs/ made relative to the site.
FROM_ROOT = {"changelog.md": "CHANGELOG.md", "security.md": "SECURITY.md"}


def from_root(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read().replace("](docs/", "](")


MARKER = re.compile(r"<!-- k3d:(errors|stats|ops|docstring ([\w.]+)) -->")


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, make in GENERATED.items():
        files.append(File.generated(config, path, content=make()))
    for path, name in FROM_ROOT.items():
        files.append(File.generated(config, path, content=from_root(name)))
    return files


def on_page_markdown(markdown, page, config, files):
    def replace(m):
        if m.group(1) == "errors":
            return errors_table()
        if m.group(1) == "stats":
            return stats_table()
        if m.group(1) == "ops":
            return ops_section()
        return docstring(m.group(2))
    return MARKER.sub(replace, markdown)
