"""Typed actors (the package's ``typed`` module) and the ArgumentModels middleware on a
StubBroker: a bad send is one ValueError line, a bad message one dead letter, versions read
one step either way. The real-process proof is the template's tests/test_job_api.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq import Message, Worker
from pydantic import AliasChoices, Field

from worker_runtime.layout import DEAD_LETTER_REASON, SCHEMA_VERSION
from worker_runtime.middleware import ArgumentModels
from worker_runtime.typed import InvalidArgumentsError, JobArguments, TypedActor, actor

from stub_brokers import SettlingStubBroker


class Greeting(JobArguments):
    version = 2
    user_id: int = Field(gt=0)
    name: str = Field(min_length=1, validation_alias=AliasChoices("name", "nickname"))
    shout: bool = False


@pytest.fixture
def broker() -> Iterator[SettlingStubBroker]:
    stub = SettlingStubBroker(middleware=[ArgumentModels()])
    stub.emit_after("process_boot")
    dramatiq.set_broker(stub)
    yield stub
    stub.close()


def declare(broker: SettlingStubBroker, seen: list[Any]) -> TypedActor:
    @actor(broker=broker, queue_name="greetings")
    def greet(job: Greeting) -> None:
        seen.append(job)

    assert isinstance(greet, TypedActor)
    return greet


def test_a_bad_send_is_one_value_error_line_naming_actor_field_and_rule(
    broker: SettlingStubBroker,
) -> None:
    greet = declare(broker, [])
    with pytest.raises(ValueError) as error:
        greet.send(user_id=0, name=None)
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith("greet: invalid arguments: user_id: Input should be greater than 0")
    assert "name: Input should be a valid string (got None)" in text
    with pytest.raises(InvalidArgumentsError, match="shoot: Extra inputs are not permitted"):
        greet.send(user_id=1, name="a", shoot=True)
    with pytest.raises(InvalidArgumentsError, match="4 positional arguments, the model has 3"):
        greet.send(1, "a", True, "x")
    assert broker.queues["greetings"].qsize() == 0


def test_a_send_carries_the_models_json_and_its_version(broker: SettlingStubBroker) -> None:
    greet = declare(broker, [])
    sent = greet.send(7, "ada")
    assert sent.args == () and sent.kwargs == {"user_id": 7, "name": "ada", "shout": False}
    assert sent.options[SCHEMA_VERSION] == 2
    model = Greeting(user_id=8, name="bob")
    assert greet.send(model).kwargs["user_id"] == 8


def run(broker: SettlingStubBroker, *messages: Message[Any]) -> None:
    for message in messages:
        broker.enqueue(message)
    worker = Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        broker.join("greetings", timeout=5000, fail_fast=False)
        worker.join()
    finally:
        worker.stop()


def raw(kwargs: Any, version: int | None = None, args: tuple[Any, ...] = ()) -> Message[Any]:
    options = {} if version is None else {SCHEMA_VERSION: version}
    return Message(
        queue_name="greetings", actor_name="greet", args=args, kwargs=kwargs, options=options
    )


def test_a_bad_message_is_dead_lettered_once_and_never_runs(broker: SettlingStubBroker) -> None:
    seen: list[Any] = []
    declare(broker, seen)
    run(broker, raw({"user_id": "x", "name": "ada"}, 2))
    assert seen == []
    (settlement,) = broker.settlements()
    assert settlement.kind == "dead_letter"
    reason = json.loads(settlement.body)["options"][DEAD_LETTER_REASON]
    assert reason.startswith("invalid arguments: user_id: Input should be a valid integer")


def test_versions_one_step_either_way_are_read_others_dead_lettered(
    broker: SettlingStubBroker,
) -> None:
    seen: list[Any] = []
    declare(broker, seen)
    run(
        broker,
        raw({"user_id": 1, "nickname": "old"}, 1),  # the previous version: the old name
        raw({}, None, args=(2, "legacy")),  # sent before the actor was typed: version 1
        raw({"user_id": 3, "name": "new", "colour": "red"}, 3),  # next: unknown field ignored
        raw({"user_id": 4, "name": "far"}, 4),  # two ahead: refused
    )
    assert [(job.user_id, job.name) for job in seen] == [(1, "old"), (2, "legacy"), (3, "new")]
    kinds = [settlement.kind for settlement in broker.settlements()]
    assert kinds == ["ack", "ack", "ack", "dead_letter"]
    reason = json.loads(broker.settlements()[-1].body)["options"][DEAD_LETTER_REASON]
    assert "schema version 4 is not read here (this worker reads 1 to 3)" in reason


def test_a_typed_actor_must_take_one_model(broker: SettlingStubBroker) -> None:
    with pytest.raises(TypeError, match="typed actor 'loose' must take one argument annotated"):

        @actor(broker=broker, queue_name="greetings")
        def loose(user_id: int) -> None: ...


def test_a_direct_call_validates_too(broker: SettlingStubBroker) -> None:
    seen: list[Any] = []
    greet = declare(broker, seen)
    greet(5, "eve")
    assert seen == [Greeting(user_id=5, name="eve")]
    with pytest.raises(InvalidArgumentsError):
        greet(0, "eve")
