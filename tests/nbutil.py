"""Small notebooks for the job tests, written with nbformat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A Python 3 notebook of code ``cells``; the first is tagged
    ``parameters`` (papermill injects parameters after it)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for i, source in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source)
        if i == 0:
            cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def new_shell() -> Any:
    """IPython's shell instance for the magics tests, its history in memory:
    a history file under a home directory a test had removed failed
    IPython's exit hook after the run ("attempt to write a readonly
    database")."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    return InteractiveShell.instance(config=Config({"HistoryManager": {"hist_file": ":memory:"}}))
