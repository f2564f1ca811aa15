"""The web console (``console``, ``CONSOLE_IN_EXPORTER``): :mod:`.server`."""
