"""The runtime's tests run with pytest directly, no bake: the test service is the template's
own service package and pools.toml, rendered (:mod:`templateservice`: package ``service``,
every option on), its processes ``python -m service`` with it on PYTHONPATH. The fixtures (a
private redis-server, Sentinels, ``jobs``) are the runtime's pytest plugin,
:mod:`worker_runtime.testing`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # templateservice and stub_brokers, whatever the rootdir
    sys.path.insert(0, str(HERE))

import templateservice  # noqa: E402

SRC = templateservice.render()
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
# The service's processes (python -m service) find it the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SRC), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)

import service  # noqa: E402  (constructs the Service the runtime runs)

SERVICE = service.SERVICE
#: The test service's project folder: its pools.toml.
SERVICE_HOME = SERVICE.root
assert SERVICE_HOME == templateservice.HOME, SERVICE_HOME
