"""The web console (``console``, ``CONSOLE_IN_EXPORTER``): the pages (:mod:`.pages`, each
in the module of its concept) and their server (:mod:`.server`)."""
