"""The web console (``console``, ``CONSOLE_IN_EXPORTER``): the pages (:mod:`.pages`) and
their server (:mod:`.server`)."""
