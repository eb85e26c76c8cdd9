"""The build the tests run against is the one the run asked for."""

import vmalloc

from tests_support import SANITIZED_RUN


def test_sanitizer_build_is_loaded_when_expected():
    assert vmalloc._C.build_info()["sanitized"] == SANITIZED_RUN


def test_cuda_h_was_found():
    assert vmalloc._C.build_info()["cuda_h_version"] >= 11030
