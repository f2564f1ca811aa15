"""{{ cookiecutter.description }}.

:data:`SERVICE` is the one description of this service that the worker runtime
(``worker_runtime``, pinned in pyproject.toml) is given: it finds the actors, the broker,
the settings and pools.toml through it.
"""

import worker_runtime

__version__ = "0.1.0"

SERVICE = worker_runtime.Service(
    package=__name__,
    project="{{ cookiecutter.project }}",
    version=__version__,
    description="{{ cookiecutter.description }}",
)
