"""Fixtures of the kvbench reliability tests."""

from __future__ import annotations

import pytest

from tests.kvbench.cli_util import make_haystack_dir, make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama model folder (byte-level tokenizer) for end-to-end runs of run.py."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def haystack_dir(tmp_path_factory):
    """A folder of two short .txt essays for NIAH runs (``task.haystack_dir``)."""
    return make_haystack_dir(tmp_path_factory.mktemp("haystack"))
