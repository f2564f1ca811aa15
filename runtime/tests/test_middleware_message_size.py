"""MessageSize: the size it measures is the size Dramatiq's encoder writes, and a message
over ``MAX_MESSAGE_BYTES`` is refused at ``send`` with one line naming actor and size."""

from __future__ import annotations

import json
from typing import Any

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.brokers.stub import StubBroker
from hypothesis import given
from hypothesis import strategies as st

from worker_runtime.middleware import message_size
from worker_runtime.middleware.message_size import (
    MessageSize,
    MessageTooLargeError,
    encoded_size,
    json_size,
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text() | st.integers() | st.booleans(), children, max_size=4)
    ),
    max_leaves=20,
)


@given(JSON)
def test_json_size_is_the_length_of_dramatiqs_encoding(value: Any) -> None:
    message: Message[Any] = Message(
        queue_name="q", actor_name="a", args=(value,), kwargs={"k": value}, options={}
    )
    assert encoded_size(message) == len(message.encode())


def test_a_long_string_is_measured_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(message_size, "SLICE_CHARS", 3)
    text = 'ab"c\\déf\n\U0001f600' * 5
    assert json_size(text) == len(json.dumps(text))
    nested = {"k": [text, 1.5, None], 7: True}
    assert json_size(nested) == len(json.dumps(nested, separators=(",", ":")))


def test_a_send_over_the_limit_raises_one_line_naming_actor_and_size() -> None:
    broker = StubBroker(middleware=[MessageSize(1024)])
    broker.emit_after("process_boot")

    @dramatiq.actor(broker=broker, queue_name="q")
    def upload(data: str) -> None:
        """Takes its data inline (it should take a reference)."""

    upload.send("x" * 100)  # small: sent
    with pytest.raises(MessageTooLargeError) as refused:
        upload.send("x" * 5000)
    text = str(refused.value)
    assert text.startswith("message for actor 'upload' is 5,")
    assert "bytes, over MAX_MESSAGE_BYTES (1,024)" in text and "\n" not in text
    assert isinstance(refused.value, ValueError)
    assert broker.queues["q"].qsize() == 1, "only the small message was enqueued"
