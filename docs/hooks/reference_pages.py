"""The reference pages generated from the code: command line, configuration, metrics, Python API.

Each ``*_page()`` returns one page's Markdown, built when the site is built, from:

- ``cli_page``: the argparse parsers ``k3d`` and ``k3ctl`` build (``parsers()``: each is
  captured where its ``main`` hands it to ``k3d.commands.ctl.parse_args``, so the page shows
  what ``--help`` shows, subcommands added by any module included);
- ``config_page``: every field of ``k3d.config.Config``: type, default, environment
  variable, option, meaning (the option's help, else the comment beside the field), and
  whether SIGHUP changes it (``k3d.serve.reload.LIVE``);
- ``metrics_page``: every family ``k3d.observe.metrics.families`` yields for a status dict
  that carries every field the daemon has a metric for;
- ``python_api_page``: the names in ``k3client.__all__``, their signatures and docstrings.

``missing_help`` and ``config_docs`` are what ``tests/unit/test_docs_site.py`` checks (an
option without help, a config key without a doc).  Everything imports the checkout that
holds this file (``ROOT`` goes first on ``sys.path``), never another installed copy.  Pure
functions of the code; run in the mkdocs process (``reference.py``) or a test, one thread.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_checkout() -> None:
    """Put the checkout first, so the pages describe this tree's code."""
    if sys.path[:1] != [ROOT]:
        sys.path.insert(0, ROOT)
    for name in [m for m in sys.modules if m.split(".")[0] in ("k3d", "k3client")]:
        mod_file = getattr(sys.modules[name], "__file__", None) or ""
        if not mod_file.startswith(ROOT + os.sep):
            del sys.modules[name]


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__("parser captured")
        self.parser = parser


def _capture(module, main) -> argparse.ArgumentParser:
    """The top-level parser ``main`` builds, taken where it calls ``parse_args(ap, sub, argv)``."""
    original = module.parse_args

    def grab(ap, sub, argv):
        raise _Captured(ap)

    module.parse_args = grab
    try:
        main([])
    except _Captured as c:
        return c.parser
    finally:
        module.parse_args = original
    raise RuntimeError(f"{module.__name__}.main never called parse_args")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """``{"k3d": parser, "k3ctl": parser}``, as their console scripts build them."""
    _import_checkout()
    cli = importlib.import_module("k3d.commands.cli")
    ctl = importlib.import_module("k3d.commands.ctl")
    return {"k3d": _capture(cli, cli.main), "k3ctl": _capture(ctl, ctl.main)}


def _subcommands(parser):
    """(name, help, subparser) for each subcommand, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name), sub


def options(parser):
    """The parser's own options and positionals (not help, not the subcommand switch)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def missing_help() -> list[str]:
    """Every option or subcommand of ``k3d``/``k3ctl`` without help text, as ``k3d start --x``."""
    missing = []
    for prog, parser in parsers().items():
        for action in options(parser):
            if action.help in (None, "") and not isinstance(action, argparse._VersionAction):
                missing.append(f"{prog} {_flag(action)}")
        for name, text, sub in _subcommands(parser):
            if not text:
                missing.append(f"{prog} {name} (the subcommand)")
            for action in options(sub):
                if not action.help:
                    missing.append(f"{prog} {name} {_flag(action)}")
    return missing


def _flag(action) -> str:
    return ", ".join(action.option_strings) if action.option_strings else action.dest


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _help(parser, action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return _cell(text)


def _arg(action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.metavar or action.dest.upper()


def _options_table(parser) -> list[str]:
    rows = ["| option | argument | meaning |", "|---|---|---|"]
    for action in options(parser):
        name = " ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        arg = _arg(action)
        if action.nargs == "?":
            arg = f"[{arg}]"
        rows.append(f"| {name} | {_cell(f'`{arg}`') if arg else ''} | {_help(parser, action)} |")
    return rows


def cli_page() -> str:
    out = ["# Command line", "",
           "Generated from the argparse parsers of `k3d` and `k3ctl` when this site is built "
           "(`docs/hooks/reference.py`): what `--help` prints, as tables.  "
           "Every `k3d start` option is also a config key: see [Configuration](config.md).", ""]
    for prog, parser in parsers().items():
        out += [f"## `{prog}`", "", _cell(parser.description or ""), "",
                "```", parser.format_usage().strip(), "```", ""]
        top = [a for a in options(parser) if a.option_strings]
        if top:
            out += _options_table(parser) + [""]
        for name, text, sub in _subcommands(parser):
            out += [f"### `{prog} {name}`", "", _cell(text or ""), ""]
            if sub.description:
                out += [_cell(sub.description), ""]
            out += ["```", sub.format_usage().strip(), "```", ""]
            if options(sub):
                out += _options_table(sub) + [""]
    return "\n".join(out)


def _field_comments(cls) -> dict[str, str]:
    """The comments written beside (and on continuation lines below) each field of ``cls``."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body[0].body
    comments: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            parts = []
            line = lines[node.lineno - 1]
            if "#" in line:
                parts.append(line.split("#", 1)[1].strip())
            i = node.end_lineno
            while i < len(lines) and lines[i].strip().startswith("#"):
                parts.append(lines[i].strip()[1:].strip())
                i += 1
            comments[node.target.id] = " ".join(parts)
    return comments


def config_docs() -> list[dict]:
    """One dict per ``Config`` field: key, type, default, env, option, doc, live."""
    _import_checkout()
    config = importlib.import_module("k3d.config")
    reload = importlib.import_module("k3d.serve.reload")
    sizes = importlib.import_module("k3d.sizes")
    start = {n: s for n, _t, s in _subcommands(parsers()["k3d"])}["start"]
    by_dest = {a.dest: a for a in options(start)}
    comments = _field_comments(config.Config)
    defaults = config.Config()
    rows = []
    for f in dataclasses.fields(config.Config):
        action = by_dest.get(f.name)
        default = getattr(defaults, f.name)
        if f.name in ("arena", "disk_cache_size"):
            default = sizes.show_size(default)
        elif default in ("", None):
            default = "—"
        doc = _help(start, action) if action is not None and action.help else _cell(comments.get(f.name, ""))
        if not doc:
            doc = _cell(comments.get(f.name, ""))
        rows.append({"key": f.name, "type": str(f.type), "default": default,
                     "env": f"K3D_{f.name.upper()}",
                     "option": ", ".join(action.option_strings) if action is not None else "",
                     "doc": doc, "live": f.name in reload.LIVE})
    return rows


def config_page() -> str:
    out = ["# Configuration", "",
           "Generated from `k3d.config.Config` when this site is built.  A key is set, from "
           "strongest to weakest, on the command line (`k3d start --OPTION`), in the environment "
           "(`K3D_<KEY>`), in the TOML file (`--config FILE` or `K3D_CONFIG`; top-level keys named "
           "as below), else it takes its default.  Unknown keys, values of the wrong kind and "
           "files that do not parse are one-line errors.  Keys marked *live* change on "
           "`systemctl reload k3d` (SIGHUP); the others need a restart.", "",
           "| key | default | set by | meaning |", "|---|---|---|---|"]
    for r in config_docs():
        live = "<br>*live*" if r["live"] else ""
        kind = r["type"].replace(" | ", " or ")
        set_by = (f"`{r['option']}`<br>" if r["option"] else "") + f"`{r['env']}`"
        out.append(f"| `{r['key']}`<br>{kind}{live} | `{_cell(r['default'])}` | {set_by} | {r['doc']} |")
    out += ["", "`endpoint` defaults to `ipc://$XDG_RUNTIME_DIR/k3d/k3d.sock` "
            "(`ipc:///tmp/k3d-$UID/k3d.sock` without `XDG_RUNTIME_DIR`); `state_dir` to "
            "`$STATE_DIRECTORY` under systemd, else `$XDG_STATE_HOME/k3d`, else `~/.local/state/k3d`.", ""]
    return "\n".join(out)


def _full_status() -> dict:
    """A status dict with every field ``families`` turns into a metric (values are zeros)."""
    stats_mod = importlib.import_module("k3d.observe.stats")
    metrics = importlib.import_module("k3d.observe.metrics")
    latency = importlib.import_module("k3d.observe.latency")
    stats = {**stats_mod.Counters().as_dict(), **{k: 0 for k in metrics.HELP}}
    return {
        "state": "serving", "uptime_s": 0.0, "clients": [],
        "stats": stats,
        "arena": {field: 0 for field, _text in metrics.ARENA_GAUGES.values()},
        "readers": {"queued_urgent": 0, "queued_background": 0, "held_back": 0},
        "fetch_seconds": latency.FetchLatency().as_dict(),
        "prediction": {"daemon": {**{k: 0 for k in metrics.AUTO}, "cpu_s": 0.0}},
        "model": {"tiers": {"origin": {**{k: 0 for k in metrics.ORIGIN}, "up": True},
                            "disk": {k: 0 for k in (*metrics.DISK, *metrics.DISK_GAUGES)}}},
    }


def metric_families() -> list[tuple[str, str, str, str]]:
    """(name as scraped, type, help, labels) of every family, starting ones included."""
    _import_checkout()
    metrics = importlib.import_module("k3d.observe.metrics")
    seen, out = set(), []
    for st in (_full_status(), {"state": "starting", "done": 0, "total": 1}):
        for fam in metrics.families(st):
            if fam.name in seen:
                continue
            seen.add(fam.name)
            name = fam.name + ("_total" if fam.type == "counter" else "")
            labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
            out.append((name, fam.type, fam.documentation, ", ".join(labels)))
    return out


def metrics_page() -> str:
    out = ["# Metrics", "",
           "Generated from `k3d.observe.metrics` when this site is built.  `k3d start --metrics "
           "HOST:PORT` serves these on `/metrics` in Prometheus' text format (needs the `metrics` "
           "extra).  A scrape reads a snapshot the server loop publishes on request, so its values "
           "equal `k3ctl status --json` at the same moment.  Counters are the `stats` fields of "
           "[status](status.md) of the same names; every numeric `stats` field is exported.  "
           "`k3d_origin_*` and `k3d_disk_*` appear with a remote source, `k3d_auto_prefetch_*` with "
           "`--predict auto`; while the daemon starts only `k3d_ready` and "
           "`k3d_startup_progress_ratio` are served.", "",
           "| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, doc, labels in metric_families():
        out.append(f"| `{name}` | {kind} | {labels and f'`{labels}`'} | {_cell(doc)} |")
    out += ["", "Useful expressions: hit rate "
            "`rate(k3d_hits_total[5m]) / (rate(k3d_hits_total[5m]) + rate(k3d_misses_total[5m]))`; "
            "p99 miss latency "
            "`histogram_quantile(0.99, rate(k3d_fetch_seconds_bucket{result=\"miss\"}[5m]))`.", ""]
    return "\n".join(out)


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "")


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def python_api_page() -> str:
    _import_checkout()
    k3client = importlib.import_module("k3client")
    errors = importlib.import_module("k3client.errors")
    out = ["# Python API: `k3client`", "",
           "Generated from the docstrings of `k3client` when this site is built: the names in "
           "`k3client.__all__`.  `import k3client` needs only numpy, pyzmq and msgpack; "
           "`Expert.tensor` needs torch.  The guide is [The Python client](../guides/client.md); the "
           "transformers and vLLM integrations are [`k3client.hf`](../guides/transformers.md) and "
           "[`k3client.vllm`](../guides/vllm.md).", ""]
    error_names = []
    for name in k3client.__all__:
        obj = getattr(k3client, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            error_names.append(name)
            continue
        if inspect.isfunction(obj):
            out += [f"## `k3client.{name}{_signature(obj)}`", "", _doc(obj), ""]
        elif inspect.isclass(obj):
            out += [f"## `class k3client.{name}`", "", _doc(obj), ""]
            members = [(n, m) for n, m in vars(obj).items() if not n.startswith("_")]
            for n, m in members:
                if isinstance(m, property):
                    out += [f"### `{name}.{n}` (property)", "", _doc(m.fget), ""]
                elif inspect.isfunction(m):
                    out += [f"### `{name}.{n}{_signature(m)}`", "", _doc(m), ""]
            if dataclasses.is_dataclass(obj):
                fields = ", ".join(f"`{f.name}`" for f in dataclasses.fields(obj))
                out += [f"Fields: {fields}.", ""]
        else:
            out += [f"## `k3client.{name}`", "", f"`{obj!r}`", ""]
    out += ["## Errors", "",
            "Every error is one line a person can act on.  The daemon's derive from `K3Error`; the "
            "wire code picks the class (see [the protocol](protocol.md#errors)).  `Mismatch` is "
            "the client's own (a checkpoint that is not what the daemon serves): no wire code.", "",
            "| class | wire code | meaning |", "|---|---|---|"]
    for name in error_names:
        cls = getattr(errors, name)
        code = f"`{cls.code}`" if hasattr(cls, "code") else "—"
        out.append(f"| `{name}` | {code} | {_cell(inspect.cleandoc(cls.__dict__.get('__doc__') or ''))} |")
    out.append("")
    return "\n".join(out)


GENERATED = {
    "reference/cli.md": cli_page,
    "reference/config.md": config_page,
    "reference/metrics.md": metrics_page,
    "reference/python-api.md": python_api_page,
}
