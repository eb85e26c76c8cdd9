import pytest

try:
    import torch

    HAVE_CUDA = torch.cuda.is_available()
except Exception:  # noqa: BLE001 - no torch or a broken driver: no GPU tests
    HAVE_CUDA = False


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # @pytest.mark.cpu: a test of tests/gpu's own logic (e.g. test_sanitizer_verdict) that needs no GPU.
        if "tests/gpu/" in str(item.fspath) and item.get_closest_marker("cpu") is None:
            item.add_marker(skip)
