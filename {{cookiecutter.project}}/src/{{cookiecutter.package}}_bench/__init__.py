"""Benchmarks that drive the service from outside: never imported by the worker, the
scheduler or a producer (``make lint`` checks it).

* :mod:`.capacity`: throughput against concurrency (the ``capacity`` command).
"""
