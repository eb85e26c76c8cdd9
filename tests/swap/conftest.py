import sys


def pytest_terminal_summary(terminalreporter):
    """What the soak (test_soak.py) ran and measured, next to the allocator's counts."""
    for line in getattr(sys.modules.get("test_soak"), "SUMMARY", []):
        terminalreporter.write_line(line)
