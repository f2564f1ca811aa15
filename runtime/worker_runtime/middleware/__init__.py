"""The service's Dramatiq middleware, one per module (see ``broker.middleware_stack``)."""

from .age_limit import ClockedAgeLimit
from .arguments import ArgumentModels
from .attempts import Attempts
from .cancellation import Cancellation
from .holds import HeldCheck
from .message_size import MessageSize, MessageTooLargeError
from .metrics import Metrics
from .pipelines import Pipelines
from .progress import Progress
from .recovery import Recovery
from .results import StoredResults
from .retries import CrashAwareRetries
from .shutdown import GracefulShutdown
from .time_limit import CappedTimeLimit
from .tracing import Tracing

__all__ = [
    "ArgumentModels",
    "Attempts",
    "Cancellation",
    "CappedTimeLimit",
    "ClockedAgeLimit",
    "CrashAwareRetries",
    "GracefulShutdown",
    "HeldCheck",
    "MessageSize",
    "MessageTooLargeError",
    "Metrics",
    "Pipelines",
    "Progress",
    "Recovery",
    "StoredResults",
    "Tracing",
]
