"""MkDocs hooks that generate the pages which follow from the code (``hooks:`` in mkdocs.yml).

* ``methods/<name>.md``, one per registered method (:data:`bayeswrap.METHODS`, in listing order), and
  ``methods/index.md`` with the registry's :func:`~bayeswrap.methods.registry.method_table`: each page lists the
  method's own options with their defaults and annotations from the constructors' signatures (the MRO walk of
  :func:`~bayeswrap.methods.registry.method_option_defaults`) and their descriptions from the docstrings' ``Args``,
  then renders the module docstring (the maths and references) and the class with mkdocstrings.
* ``cli.md``: the output of ``bayeswrap --help`` and of each command's ``--help``, captured at build time by running
  ``python -m bayeswrap ... --help`` in this process (no help text is copied by hand).
* ``CONTRIBUTING.md`` and ``figures/``: the repository's files as they are (the README links to them).

The nav of mkdocs.yml holds ``methods/index.md``; :func:`on_config` expands it into the section of method pages.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import runpy
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).parent))
from griffe_napoleon import markdown_roles  # noqa: E402  (docs/, beside this file)

#: the commands whose --help the CLI page shows, in this order
CLI_COMMANDS = ((), ("fit",), ("compare",), ("evaluate",), ("predict",))
#: repository files published as they are, besides the generated pages
REPO_PAGES = ("CONTRIBUTING.md",)
REPO_FOLDERS = {"figures": (".md", ".png")}
METHODS_INDEX = "methods/index.md"


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _registry(config):
    """``bayeswrap.methods.registry`` of this checkout (its folder first on ``sys.path``)."""
    root = str(_root(config))
    if root not in sys.path:
        sys.path.insert(0, root)
    import bayeswrap  # noqa: F401  (registers every method)
    from bayeswrap.methods import registry

    if not Path(registry.__file__).resolve().is_relative_to(Path(root)):
        raise PluginError(f"bayeswrap was imported from {registry.__file__}, not from the checkout at {root}")
    return registry


def on_config(config):
    """Expands the nav entry ``methods/index.md`` into the section: the overview, then one page per method."""
    registry = _registry(config)
    pages = [METHODS_INDEX] + [{name: f"methods/{name}.md"} for name in registry.METHODS]

    def expand(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                (title, value), = item.items()
                if value == METHODS_INDEX:
                    item = {title: pages}
                elif isinstance(value, list):
                    item = {title: expand(value)}
            out.append(item)
        return out

    if config.nav is None or METHODS_INDEX not in str(config.nav):
        raise PluginError(f"mkdocs.yml's nav must name {METHODS_INDEX!r}, where the method pages go")
    config.nav = expand(config.nav)
    return config


def on_files(files: Files, config) -> Files:
    """Adds the generated pages and the repository's files to the site."""
    registry = _registry(config)
    root = _root(config)
    files.append(File.generated(config, METHODS_INDEX, content=_methods_index(registry)))
    for name in registry.METHODS:
        files.append(File.generated(config, f"methods/{name}.md", content=_method_page(registry, name)))
    files.append(File.generated(config, "cli.md", content=_cli_page()))
    for page in REPO_PAGES:
        files.append(File.generated(config, page, abs_src_path=str(root / page)))
    for folder, suffixes in REPO_FOLDERS.items():
        for path in sorted((root / folder).iterdir()):
            if path.suffix in suffixes:
                files.append(File.generated(config, f"{folder}/{path.name}", abs_src_path=str(path)))
    return files


# --- the method pages ---------------------------------------------------------------------------------------------

def _markdown(text: str) -> str:
    """The reStructuredText roles and literals of ``text`` as Markdown code spans, on one line."""
    return " ".join(markdown_roles(text).replace("``", "`").split())


def _cell(text: str) -> str:
    """Text for a table cell: ``|`` escaped outside code spans (Python-Markdown reads code spans first)."""
    parts = re.split(r"(`[^`]*`)", _markdown(text))
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _documented_options(cls) -> dict[str, str]:
    """``{option: description}`` from the ``Args`` sections of the class docstrings along the MRO (nearest first)."""
    from griffe import Docstring, DocstringSectionKind

    found: dict[str, str] = {}
    for klass in cls.__mro__:
        for doc in (vars(klass).get("__doc__"), getattr(vars(klass).get("__init__"), "__doc__", None)):
            if not doc:
                continue
            for section in Docstring(inspect.cleandoc(doc)).parse("google", warn_missing_types=False):
                if section.kind is DocstringSectionKind.parameters:
                    for param in section.value:
                        found.setdefault(param.name, param.description)
    return found


def _annotations(cls) -> dict[str, str]:
    """``{option: annotation}`` of the keyword options of the constructors along the MRO (nearest first)."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.annotation is not p.empty:
                    found.setdefault(p.name, p.annotation if isinstance(p.annotation, str)
                                     else inspect.formatannotation(p.annotation))
    return found


def _default(value) -> str:
    return "required" if value is inspect.Parameter.empty else f"`{value!r}`"


def _method_page(registry, name: str) -> str:
    cls = registry.METHODS[name]
    defaults = registry.method_option_defaults(name)
    described = _documented_options(cls)
    annotations = _annotations(cls)
    lines = [f"# `{name}`: {cls.__name__}", "", _markdown(registry.summary(cls)), "",
             "```python", f'bnn = bw.wrap(model, "{name}", num_data=len(train_set), ...)', "```", "",
             "## Options", ""]
    if defaults:
        lines += ["The method's own keyword options (`bw.method_options(\"" + name + "\")`), with the defaults of its "
                  "constructor; every method also takes the [common options](../api/model.md) of `BayesianModel` "
                  "(`num_data`, `prior_std`, `prior_mean`, `params`, `likelihood`, ...) and `kl_weight`, "
                  "`chunk_size`.", "",
                  "| option | default | type | description |", "| --- | --- | --- | --- |"]
        for option, value in defaults.items():
            annotation = annotations.get(option, "")
            lines.append(f"| `{option}` | {_cell(_default(value))} | {f'`{annotation}`' if annotation else ''}"
                         f" | {_cell(described.get(option, ''))} |")
    else:
        lines.append("Only the [common options](../api/model.md) of `BayesianModel` and `kl_weight`, `chunk_size`.")
    knob = registry.tuning_option(name)
    if knob is not None:
        option, grid = knob
        lines += ["", f"`bayeswrap compare` tunes `{option}` by validation NLL, starting from the grid "
                      f"{', '.join(f'{g:g}' for g in grid)} (extended until the optimum is bracketed)."]
    module = inspect.getmodule(cls).__name__
    lines += ["", "## Background", "", f"::: {module}",
              "    options:", "      show_root_heading: false", "      show_root_toc_entry: false", "      members: false", "",
              "## Class", "", f"::: {module}.{cls.__name__}",
              "    options:", "      heading_level: 3", "      show_docstring_parameters: false"]
    if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()):
        # the class documents options that its **kwargs pass on to BayesianModel (e.g. how it treats ``bias``)
        lines += ["      docstring_options:", "        warn_unknown_params: false", "        warn_missing_types: false"]
    lines.append("")
    return "\n".join(lines)


def _methods_index(registry) -> str:
    table = re.sub(r'^\| `"(\w+)"` \|', lambda m: f'| [`"{m.group(1)}"`]({m.group(1)}.md) |',
                   registry.method_table(), flags=re.MULTILINE)
    return "\n".join([
        "# Methods", "",
        "`bw.wrap(model, name, num_data=N, ...)` takes the name of a registered method. Each page lists the method's "
        "own options with their defaults, then its maths and references. The table and the pages are generated "
        "from the registry (`bayeswrap.METHODS`), so they list exactly the registered methods.", "",
        table])


# --- the command line page ----------------------------------------------------------------------------------------

def _help(command: tuple[str, ...]) -> str:
    """The output of ``python -m bayeswrap *command --help``, run in this process (the imports are done)."""
    argv, columns, out = sys.argv, os.environ.get("COLUMNS"), io.StringIO()
    sys.argv, os.environ["COLUMNS"] = ["bayeswrap", *command, "--help"], "80"
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("bayeswrap", run_name="__main__", alter_sys=False)
        status = None
    except SystemExit as exit_:
        status = exit_.code
    finally:
        sys.argv = argv
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    if status not in (0, None) or not out.getvalue().strip():
        raise PluginError(f"{' '.join(['bayeswrap', *command, '--help'])} exited with {status!r}")
    return out.getvalue()


def _cli_page() -> str:
    helps = [_help(command) for command in CLI_COMMANDS]
    lines = ["# Command line", "",
             "`pip install -e .` installs the `bayeswrap` command (also `python -m bayeswrap`). The help below is the "
             "output of each command's `--help`, captured when this site was built.", ""]
    for command, text in zip(CLI_COMMANDS, helps):
        title = " ".join(["bayeswrap", *command])
        lines += [f"## `{title}`", "", "```text", f"$ {title} --help", text.rstrip("\n"), "```", ""]
    return "\n".join(lines)
