"""Files the book ships beside its code: trained runs (models/) and the text a model reads (data/).

In the repository they sit in folders beside code/. A notebook opened elsewhere (Colab, a
download) has only the code: there ``locate`` fetches the files once, from beside the published
code/ folder whose address the setup cell puts in the environment variable ATTENTION_CODE_URL.

- ``locate(relative, names, folder)``: the folder that holds the files ``names`` of
  ``relative`` (``"models/induction"``, ``"data"``), fetching them when they are missing;
- ``save_run`` and ``load_run``: a trained run as ``<name>.pt`` (its ``state_dict``) and
  ``<name>.json`` (what the run says of itself, torch's version and the SHA-256 of the .pt,
  which ``load_run`` checks).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import urllib.request
from typing import Optional, Sequence

import torch

__all__ = ["CODE_URL", "sha256", "locate", "save_run", "load_run"]

CODE_URL = "ATTENTION_CODE_URL"  # the address of the book's code/ folder; the setup cell sets it


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _repository(relative: str) -> Optional[pathlib.Path]:
    """``relative`` in the repository, when this file sits in its code/ folder."""
    here = pathlib.Path(__file__).resolve().parent
    folder = here.parent / relative
    return folder if here.name == "code" and folder.is_dir() else None


def _fetch(relative: str, names: Sequence[str], folder: pathlib.Path) -> None:
    """Fetch the files ``names`` of ``relative`` from beside the code/ folder at the address
    ATTENTION_CODE_URL gives (the setup cell sets it to the published repository's, at the
    book's ref), into ``folder``."""
    base = os.environ.get(CODE_URL)
    if not base:
        raise RuntimeError(
            f"{relative}/{names[0]} is not here and {CODE_URL} is not set: run the notebook's "
            "first cell, or set it to the address of the book's code/ folder")
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        url = f"{base.rstrip('/').rsplit('/', 1)[0]}/{relative}/{name}"
        try:
            urllib.request.urlretrieve(url, folder / name)
        except OSError as err:
            raise RuntimeError(
                f"could not fetch {url}: {err}. Put {relative}/{name} in {folder}, or set "
                f"{CODE_URL} to the address of a copy of the book's code/ folder ({relative}/ "
                "is fetched from beside it)") from None


def locate(relative: str, names: Sequence[str], folder=None, *, make: str = "") -> pathlib.Path:
    """The folder holding the files ``names`` of ``relative``: ``folder`` if given, else the
    repository's ``relative`` when this file sits in its code/ folder, else ``relative`` beside
    this file. Missing files are fetched (``_fetch``), except into the repository's own
    folder: there a missing file is an error that says ``make``, how to make it."""
    repository = _repository(relative)
    folder = pathlib.Path(folder or repository or pathlib.Path(__file__).resolve().parent / relative)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        if repository is not None and folder.resolve() == repository.resolve():
            raise FileNotFoundError(f"{folder / missing[0]} is missing" + (
                f": {make}" if make else ""))
        _fetch(relative, names, folder)
    return folder


def save_run(folder, name: str, state_dict: dict, head: dict, log: list) -> dict:
    """Write ``<name>.pt`` (``state_dict``) and ``<name>.json`` into ``folder``: ``head`` (what
    the run says of itself: its name, config, seed), torch's version, the .pt's SHA-256 and
    ``log``, in that order. Returns what the JSON holds."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / f"{name}.pt"
    torch.save(state_dict, weights)
    record = {**head, "torch": torch.__version__, "sha256": sha256(weights), "log": log}
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_run(relative: str, name: str, folder=None, *, make: str = "") -> tuple[dict, dict]:
    """The JSON record and the ``state_dict`` of the run ``name`` of ``relative``, found by
    ``locate``. The weights' SHA-256 must be the one their JSON records."""
    folder = locate(relative, [f"{name}.json", f"{name}.pt"], folder, make=make)
    weights = folder / f"{name}.pt"
    record = json.loads((folder / f"{name}.json").read_text())
    found = sha256(weights)
    if found != record["sha256"]:
        raise ValueError(
            f"{weights}: its SHA-256 is {found}, but {name}.json records {record['sha256']}; "
            "the weights are not the ones that run wrote. Delete both files to fetch them "
            f"again{', or ' + make if make else ''}")
    return record, torch.load(weights, weights_only=True)
