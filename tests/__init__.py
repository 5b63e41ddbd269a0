"""The test suite, a package: its helpers import as ``tests.utils`` (never a ``utils`` from
site-packages) and a test file's helpers as ``tests.test_<name>``."""
