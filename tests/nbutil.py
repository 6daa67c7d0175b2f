"""Small notebooks for the job tests, written with nbformat."""

from __future__ import annotations

from pathlib import Path

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
