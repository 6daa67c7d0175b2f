"""Sphinx configuration of the gpubroker documentation (MyST Markdown).

``make docs`` runs ``sphinx-build -W --keep-going -b html docs docs/_build/html``:
every warning fails the build. Nothing here uses the network (no intersphinx).

The REST API page is rendered by sphinxcontrib-openapi from
``gpubroker/api/openapi.yaml``. That document is OpenAPI 3.1; the renderer
handles 3.1's ``type: [X, "null"]`` poorly (it prints the list, drops the
properties of nullable objects), so :func:`write_openapi_30` writes a
3.0-style copy to ``docs/_build/generated/openapi.yaml`` (inside the ignored
build directory) before the sources are read.

The admin guide shows the production example hub config
(``jupyterhub_config/jupyterhub_config.py``) when the checkout has it:
:func:`write_production_config_snippet` writes the include (or a note) to
``docs/_build/generated/production-config.md``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
# `make setup` installs the project in editable mode; this keeps a plain checkout
# importable too (gpubroker_spawner is the spawner/ folder, mapped by pyproject.toml)
sys.path.insert(0, str(REPO))

import gpubroker  # noqa: E402

OPENAPI_SOURCE = REPO / "gpubroker" / "api" / "openapi.yaml"
GENERATED = DOCS / "_build" / "generated"
OPENAPI_GENERATED = GENERATED / "openapi.yaml"
PRODUCTION_CONFIG = REPO / "jupyterhub_config" / "jupyterhub_config.py"

# -- project -------------------------------------------------------------------------

project = "gpubroker"
author = "gpubroker developers"
copyright = "gpubroker developers"
release = gpubroker.__version__
version = release

# -- general ---------------------------------------------------------------------------

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxcontrib.openapi",
    "autodoc_traits",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
nitpicky = False

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc ---------------------------------------------------------------------------

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# enum docstrings list their values under "Members:" (e.g. LinkLevel)
napoleon_custom_sections = [("Members", "params_style")]

# -- OpenAPI ---------------------------------------------------------------------------

openapi_default_renderer = "httpdomain"

# -- HTML ------------------------------------------------------------------------------

html_theme = "alabaster"
html_title = f"gpubroker {release}"
html_theme_options = {
    "description": "A GPU broker for JupyterHub",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_static_path: list[str] = []


# -- OpenAPI 3.1 -> 3.0-style copy -------------------------------------------------------


def _to_30(node: Any) -> Any:
    """Rewrite 3.1-only schema keywords into their 3.0 spelling, recursively.

    ``type: [X, "null"]`` becomes ``type: X`` + ``nullable: true`` (and the
    description says it may be null); ``const: v`` becomes ``enum: [v]``.
    """
    if isinstance(node, list):
        return [_to_30(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _to_30(value) for key, value in node.items()}
    kind = out.get("type")
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        if len(others) == 1:
            out["type"] = others[0]
        else:
            out.pop("type")
        if "null" in kind:
            out["nullable"] = True
            note = "May be ``null``."
            out["description"] = (
                f"{out['description'].rstrip()} {note}" if out.get("description") else note
            )
    if "const" in out:
        out["enum"] = [out.pop("const")]
    if isinstance(out.get("enum"), list) and out.get("type") != "object":
        # the renderer prints "string:enum" without the values: name them
        values = ", ".join(f"``{v}``" for v in out["enum"])
        note = f"One of {values}." if len(out["enum"]) > 1 else f"Always {values}."
        desc = str(out.get("description", "")).rstrip()
        out["description"] = f"{desc} {note}" if desc else note
    return out


def write_openapi_30(app: Any = None, config: Any = None) -> Path:
    """Write the 3.0-style copy of the OpenAPI document; return its path."""
    spec = yaml.safe_load(OPENAPI_SOURCE.read_text(encoding="utf-8"))
    converted = _to_30(copy.deepcopy(spec))
    converted["openapi"] = "3.0.3"
    converted.get("info", {}).pop("summary", None)  # 3.1 only
    text = yaml.safe_dump(converted, sort_keys=False, allow_unicode=True)
    return _write_if_changed(OPENAPI_GENERATED, text)


def _write_if_changed(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text("utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


def write_production_config_snippet(app: Any = None, config: Any = None) -> Path:
    """Write the admin guide's include for the production example config."""
    if PRODUCTION_CONFIG.exists():
        text = (
            "```{literalinclude} /../jupyterhub_config/jupyterhub_config.py\n"
            ":language: python\n"
            ":caption: jupyterhub_config/jupyterhub_config.py\n"
            "```\n"
        )
    else:
        text = (
            "This checkout has no `jupyterhub_config/jupyterhub_config.py` yet; "
            "the sections above show every setting gpubroker needs, and "
            "`jupyterhub_config/demo_config.py` is a complete, working example.\n"
        )
    return _write_if_changed(GENERATED / "production-config.md", text)


def _hide_configurable_signature(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: Any, annotation: Any
) -> tuple[str, Any] | None:
    """Traitlets classes are configured, not called: drop their ``(**kwargs)``."""
    from traitlets import HasTraits

    if isinstance(obj, type) and issubclass(obj, HasTraits):
        return "", annotation
    return None


def setup(app: Any) -> None:
    """Generate the files the sources include, before they are read."""
    app.connect("autodoc-process-signature", _hide_configurable_signature)
    app.connect("config-inited", write_openapi_30)
    app.connect("config-inited", write_production_config_snippet)
