"""The runtime's test service: the example actors and pools.toml of a default bake (with the
database and the sandbox), on the seam a bake has (``SERVICE``, ``broker``, ``settings``,
``actors``). Its processes run as ``python -m service`` with ``runtime/tests`` on the path."""

from pathlib import Path

import worker_runtime

__version__ = "0.1.0"

SERVICE = worker_runtime.Service(
    package=__name__,
    project="test-service",
    version=__version__,
    description="The runtime's test service",
    home=Path(__file__).resolve().parent,
)
