"""What several test files share: the test devices (``devices``), inputs built by seed and
shape, tiny configs, numerical checks and files on disk. Fixtures stay in conftest.py."""
