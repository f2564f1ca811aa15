"""The service's command line: :func:`main` runs every command of the contract for a
:class:`~worker_runtime.Service` (the bake's ``__main__`` calls it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..service import Service


def main(service: Service, argv: list[str] | None = None) -> int:
    """``python -m <package>`` and the ``<project>`` script (:func:`.main.main`)."""
    from .main import main as run

    return run(service, argv)
