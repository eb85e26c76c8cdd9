from fakecuda.fixtures import fakecuda  # noqa: F401
