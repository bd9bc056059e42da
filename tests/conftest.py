"""Shared test set-up: markers and the `gpu` skip rule."""

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not the keyword: a test's keywords hold its folders' names (tests/engine/gpu)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
