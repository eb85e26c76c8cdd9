import pytest

from fakecuda.fixtures import fakecuda  # noqa: F401


@pytest.fixture
def streams(fakecuda):  # noqa: F811 - the fixture imported above
    """Makes streams (``streams(nonblocking=False)``) and destroys them after the test."""
    made = []

    def make(nonblocking=False):
        made.append(fakecuda.stream(nonblocking))
        return made[-1]

    yield make
    for s in made:
        fakecuda.destroy_stream(s)
