"""The database option: this worker process's PostgreSQL pool (``DB_POOL_SIZE`` connections,
opened at boot by pools that use ``postgres`` in pools.toml; :mod:`worker_runtime.db`)::

    from {{ cookiecutter.package }}.db import connection

    with connection() as conn:
        conn.execute("insert into ...")
"""

from worker_runtime.db import connection

__all__ = ["connection"]
