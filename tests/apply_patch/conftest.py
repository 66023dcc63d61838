"""The reference binary, or a skip saying how to install it."""

import os

import pytest

from .parity import INSTALL_HINT, reference_path


@pytest.fixture(scope="session")
def reference():
    path = reference_path()
    if not os.access(path, os.X_OK):
        pytest.skip(f"reference apply_patch not found at {path}: {INSTALL_HINT}")
    return path
