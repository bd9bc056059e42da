"""The checks of one catalog entry's fields (`app.catalog` parses; these say what is wrong).

Each raises ValueError with a sentence naming the field, which `app.catalog` turns into a
`CatalogError` naming the entry.
"""

from __future__ import annotations

import re

from app.model_library import QUANT_NAME
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.model.check_gguf import GGUF_MODEL_TYPES

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
BF16 = "safetensors-bf16"
FORMATS = {BF16: "BF16", "gguf": "GGUF", "mxfp4": "MXFP4", "fp8": "FP8"}  # format → what the picker says
STATUSES = ("available", "coming")
REASON_CHARS = 80  # a "coming" reason fits the picker's status column (three lines at most)
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split


def check_values(item: dict, bundled: bool, repo_id: object, draft: object) -> None:
    if item["architecture"] not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"architecture {item['architecture']!r} is not one MoE Chat supports "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if bundled == (repo_id is not None):
        raise ValueError("needs a repo_id, or bundled: true, but not both")
    for key, value in (("repo_id", repo_id), ("draft_repo", draft)):
        if value is not None and (not isinstance(value, str) or not _REPO_ID.match(value) or "--" in value):
            raise ValueError(f"{key} {value!r} is not an 'org/name' Hub id")
    if not 0 < item["active_params"] <= item["total_params"]:
        raise ValueError("active_params must be positive and at most total_params")
    if not 0 < item["top_k"] <= item["num_experts"]:
        raise ValueError("top_k must be positive and at most num_experts")
    if not 0 < item["expert_share"] < 1:
        raise ValueError("expert_share must lie between 0 and 1")
    if item["download_bytes"] <= 0:
        raise ValueError("download_bytes must be positive")


def check_release(item: dict) -> tuple[str, ...]:
    """The format, quant and GGUF file(s) of one release; the files to fetch."""
    form, quant = item["format"], item.get("quant")
    if form not in FORMATS:
        raise ValueError(f"format {form!r} is not one of {', '.join(FORMATS)}")
    if (form == BF16) != (quant is None):
        raise ValueError("a quant (Q4_K_M, MXFP4, FP8…) is needed for a quantized format, and only then")
    if quant is not None and not QUANT_NAME.match(quant):
        raise ValueError(f"quant {quant!r} is not a quant name such as Q4_K_M")
    file, files = item.get("file"), item.get("files")
    if form != "gguf":
        if file is not None or files is not None:
            raise ValueError("'file'/'files' choose what to fetch from a GGUF repo: only for format gguf")
        return ()
    if item["architecture"] not in GGUF_MODEL_TYPES.values():
        readable = ", ".join(sorted(GGUF_MODEL_TYPES.values()))
        raise ValueError(f"MoE Chat reads GGUF files of {readable}, not {item['architecture']!r}")
    if (file is None) == (files is None):
        raise ValueError("a gguf entry names its 'file', or the 'files' of a split set (one of them)")
    names = (file,) if file is not None else tuple(files)
    for name in names:
        parts = name.split("/") if isinstance(name, str) else [""]
        if not isinstance(name, str) or not name.endswith(".gguf") or "" in parts or ".." in parts:
            raise ValueError(f"{name!r} is not the path of a .gguf file in the repo")
    if files is not None:
        _check_split_set(names)
    return names


def _check_split_set(names: tuple[str, ...]) -> None:
    """`files` are every part of one `-0000k-of-0000N.gguf` set, in order."""
    folder, _, name = names[0].rpartition("/")
    first = _SPLIT.match(name)
    count = int(first["count"]) if first else 0
    stem = f"{folder}/{first['stem']}" if folder and first else first["stem"] if first else ""
    if not first or names != tuple(f"{stem}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)):
        raise ValueError("'files' must list every part of one split set, -00001-of-0000N.gguf first")


def check_status(status: str, reason: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
    if (status == "coming") != bool(reason):
        raise ValueError("a 'coming' entry says why in status_reason, and only a 'coming' one")
    if len(reason) > REASON_CHARS:
        raise ValueError(f"status_reason must be at most {REASON_CHARS} characters (the notes say more)")
