"""Shared fixtures: tiny models built on the spot (random weights) and the shipped trained ones."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from worlds import tiny_world  # noqa: E402


@pytest.fixture(scope="session")
def untrained_models(tmp_path_factory) -> str:
    """A folder with random-init teacher/ and student/ (tokenizer and processor included)."""
    return tiny_world.save_untrained(str(tmp_path_factory.mktemp("untrained")), seed=0)


@pytest.fixture(scope="session")
def trained_models() -> str:
    """The shipped assets/tiny folder (trained teacher/ and student/)."""
    path = os.path.join(ROOT, "assets", "tiny")
    if not os.path.isdir(os.path.join(path, "teacher")):
        pytest.fail("assets/tiny is missing: regenerate it with `python -m worlds.tiny_world --out assets/tiny`")
    return path
