"""A queue's lanes (priorities, issue #42) against a real Redis: the fetch's order and its
starvation bound, and every script that reads or writes a queue's waiting ids (enqueue,
backlog, the console's page, recovery's requeue, a settlement's requeue and retry, the
delayed move, a dead letter's replay, a group's callbacks) seeing the lanes."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from worker_runtime import backlog, layout
from worker_runtime.redisbroker import SettlingRedisBroker
from worker_runtime.typed import JobArguments
from worker_runtime.typed import actor as typed_actor

Q = "notifications"


def body(
    job: str, priority: str | None = None, queue: str = Q, sent_ms: int = 0, **more: Any
) -> bytes:
    options: dict[str, Any] = {layout.REDIS_MESSAGE_ID: job, **more}
    if priority is not None:
        options[layout.PRIORITY_OPTION] = priority
    fields = {
        "queue_name": queue,
        "actor_name": "a",
        "args": [],
        "kwargs": {},
        "options": options,
        "message_id": f"m-{job}",
        "message_timestamp": sent_ms or int(time.time() * 1000),
    }
    return json.dumps(fields).encode()


def enqueue(
    client: redis.Redis,
    job: str,
    priority: str | None = None,
    key: str = "",
    sent_ms: int = 0,
    **more: Any,
) -> None:
    script = client.register_script(layout.ENQUEUE)
    lane = layout.DEFAULT_PRIORITY if priority is None else priority
    if key:
        more[layout.FAIRNESS_KEY_OPTION] = key
    due = sent_ms or int(time.time() * 1000)
    stored = body(job, priority, sent_ms=due, **more)
    assert layout.enqueue_message(script, Q, job, stored, f"m-{job}", False, lane, key, due)


def fetch_reply(
    client: redis.Redis,
    count: int,
    bound: int = 10,
    limit: int = 0,
    broker: str = "w",
    rate: layout.KeyRate = layout.NO_KEY_RATE,
) -> tuple[layout.Admission, list[str]]:
    keys = layout.fetch_keys(broker, Q)
    raw = client.eval(
        layout.FETCH,
        len(keys),
        *keys,
        *layout.fetch_args(count, broker, Q, bound=bound, key_limit=limit, key_rate=rate),
    )
    admission, got = layout.taken(raw)
    return admission, [redis_id for redis_id, _ in got]


def fetch(
    client: redis.Redis,
    count: int,
    bound: int = 10,
    limit: int = 0,
    rate: layout.KeyRate = layout.NO_KEY_RATE,
) -> list[str]:
    return fetch_reply(client, count, bound, limit, rate=rate)[1]


def lanes(client: redis.Redis) -> dict[str, list[str]]:
    return {
        priority: [layout.text(i) for i in client.lrange(layout.lane_key(Q, priority), 0, -1)]
        for priority in layout.PRIORITIES
    }


def test_the_fetch_takes_the_highest_lane_first(client: redis.Redis) -> None:
    for i in range(3):
        for priority in ("low", None, "high"):
            enqueue(client, f"{priority or 'normal'}{i}", priority)
    taken = [fetch(client, 1, bound=100)[0] for _ in range(9)]
    highs, normals, lows = ([f"{p}{i}" for i in range(3)] for p in ("high", "normal", "low"))
    assert taken == [*highs, *normals, *lows]
    assert fetch(client, 1, bound=100) == []


@pytest.mark.parametrize("batch", [1, 4, 100])
def test_a_waiting_job_is_passed_over_by_exactly_bound_higher_ones(
    client: redis.Redis, batch: int
) -> None:
    """Bound 3: a low job is taken after exactly 3 of a higher lane, however many are taken
    a call; with three lanes busy each lower lane keeps its own count (lowest first)."""
    for i in range(2):
        enqueue(client, f"L{i}", "low")
    for i in range(9):
        enqueue(client, f"H{i}", "high")
    taken: list[str] = []
    while got := fetch(client, batch, bound=3):
        taken += got
    assert [t[0] for t in taken] == list("HHHLHHHLHHH")
    assert not client.exists(layout.lanes_state_key(Q)), "no count left once lanes empty"

    for i in range(3):
        enqueue(client, f"L{i}", "low")
        enqueue(client, f"N{i}", None)
    for i in range(8):
        enqueue(client, f"H{i}", "high")
    taken = []
    while got := fetch(client, batch, bound=2):
        taken += got
    assert_bounded("".join(t[0] for t in taken), {"H": 8, "N": 3, "L": 3}, bound=2)


def assert_bounded(order: str, waiting: dict[str, int], bound: int) -> None:
    """Every take of ``order`` (lanes H > N > L, ``waiting`` at the start) took the highest
    lane with jobs waiting, unless its own lane had been passed over by ``bound`` jobs of
    higher lanes since it was last taken: never more."""
    rank = "HNL"
    passed = dict.fromkeys(rank, 0)
    for lane in order:
        higher_waiting = any(waiting[h] for h in rank[: rank.index(lane)])
        assert passed[lane] <= bound, (order, lane)
        assert not higher_waiting or passed[lane] == bound, (order, lane)
        for lower in rank[rank.index(lane) + 1 :]:
            passed[lower] += bool(waiting[lower])
        passed[lane] = 0
        waiting[lane] -= 1
    assert not any(waiting.values())


def test_an_unknown_priority_is_one_line_and_nothing_is_stored(
    client: redis.Redis, redis_url: str
) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    try:
        import dramatiq

        @dramatiq.actor(broker=broker, queue_name=Q, priority_lane="high")
        def urgent() -> None: ...

        message = urgent.message()
        sent = broker.enqueue(message)
        assert sent.options[layout.PRIORITY_OPTION] == "high", "the actor's default"
        assert lanes(client)["high"] == [sent.options[layout.REDIS_MESSAGE_ID]]
        with pytest.raises(layout.PriorityError) as refused:
            broker.enqueue(urgent.message_with_options(priority="urgent"))
        assert str(refused.value).count("\n") == 0
        assert "priority 'urgent' is not one of high, normal, low" in str(refused.value)
        assert client.hlen(layout.bodies_key(Q)) == 1, "nothing more stored"
        with pytest.raises(layout.PriorityError):

            @dramatiq.actor(broker=broker, queue_name=Q, priority_lane="top")
            def wrong() -> None: ...

    finally:
        broker.close()


def test_the_backlog_counts_every_lane_and_ages_the_oldest_head(client: redis.Redis) -> None:
    now = time.time()
    old = {"message_timestamp": int((now - 50) * 1000)}
    client.hset(layout.bodies_key(Q), "old-low", json.dumps(old))
    client.rpush(layout.lane_key(Q, "low"), "old-low")
    client.hset(layout.bodies_key(Q), "new", json.dumps({"message_timestamp": now * 1000}))
    client.rpush(layout.lane_key(Q, "high"), "new")
    client.rpush(layout.lane_key(Q), "new")
    (found,) = backlog.read_backlog(client, [Q], now=now)
    assert found.depth == 3
    assert 49 < found.oldest_s < 51, "the low lane's head is the oldest waiting"


def test_the_console_page_reads_the_lanes_in_line_order(client: redis.Redis) -> None:
    for i in range(3):
        for priority in ("low", None, "high"):
            enqueue(client, f"{priority or 'normal'}{i}", priority)
    total, first = layout.waiting_page(client, Q, 0, 4)
    assert total == 9
    assert [i for i, _ in first] == ["high0", "high1", "high2", "normal0"]
    _, second = layout.waiting_page(client, Q, 4, 4)
    assert [i for i, _ in second] == ["normal1", "normal2", "low0", "low1"]
    _, last = layout.waiting_page(client, Q, 8, 4)
    assert [i for i, b in last] == ["low2"] and last[0][1] is not None


def test_recovery_requeues_a_held_message_onto_its_lane(client: redis.Redis) -> None:
    enqueue(client, "h", "high")
    enqueue(client, "l", "low")
    assert sorted(fetch(client, 2, bound=10)) == ["h", "l"]
    assert layout.requeue_held(client, "w", Q, "h")
    assert layout.requeue_held(client, "w", Q, "l", body("l", "low", retries=1))
    assert lanes(client) == {"high": ["h"], "normal": [], "low": ["l"]}


def test_a_settlement_requeues_and_retries_onto_the_lane(client: redis.Redis) -> None:
    enqueue(client, "h", "high")
    enqueue(client, "l", "low")
    fetch(client, 2, bound=10)
    script = client.register_script(layout.SETTLE)

    def settle(kind: str, redis_id: str, copy: bytes = b"", target: str = "") -> None:
        keys = layout.settle_keys("w", Q, Q, ())
        args = layout.settle_args((kind, redis_id, copy, target), "w", 0, "", Q)
        assert script(keys=keys, args=args)[0] == 1

    settle("requeue", "h")
    settle("retry", "l", body("l2", "low"), "l2")
    assert lanes(client) == {"high": ["h"], "normal": [], "low": ["l2"]}


def test_a_due_delayed_message_moves_onto_its_lane(client: redis.Redis) -> None:
    delayed = layout.delay_queue(Q)
    due = body("d", "high", queue=delayed, eta=int(time.time() * 1000) - 1)
    client.hset(layout.bodies_key(delayed), "d", due)
    client.rpush(layout.queue_key(delayed), "d")
    step = layout.move_due(client.register_script(layout.MOVE_DUE), Q)
    assert step.moved == 1
    assert lanes(client) == {"high": ["d"], "normal": [], "low": []}


def test_a_replayed_dead_letter_and_a_groups_callback_go_onto_their_lane(
    client: redis.Redis,
) -> None:
    zset, bodies = layout.dead_letter_keys(Q)
    client.zadd(zset, {"x": 1})
    client.hset(bodies, "x", body("x", "low"))
    assert layout.replay_dead_letters(client, Q, [("x", "x2", body("x2", "low"), "m-x")]) == 1
    callback = layout.Callback(Q, "cb", body("cb", "high"), "m-cb", "high")
    client.set(layout.group_keys("g")[0], 1)
    assert layout.group_member_done(client, "g", "member", 60_000, [callback])
    assert lanes(client) == {"high": ["cb"], "normal": [], "low": ["x2"]}


BODIES_OPTIONS = [{}, {"priority": "high"}, {"priority": "low"}, {"priority": "normal"}]
ODD_OPTIONS = [{"priority": "x"}, {"priority": 1}, {"priority": None}, {"priority": ["high"]}]


@pytest.mark.parametrize("options", [*BODIES_OPTIONS, *ODD_OPTIONS])
def test_the_lane_read_inside_redis_is_the_one_python_names(
    client: redis.Redis, options: dict[str, Any]
) -> None:
    stored = json.dumps({"options": options})
    lua = layout.queuelanes.LANES + "local lane = route(ARGV[1]) return lane"
    index = int(client.eval(lua, 0, stored)) - 1
    assert layout.PRIORITIES[index] == layout.stored_priority(options)
    assert int(client.eval(lua, 0, "not json")) - 1 == layout.PRIORITIES.index("normal")


# -- per-key fairness ------------------------------------------------------------------


def test_keys_take_turns_so_a_big_backlog_delays_another_key_by_one_job(
    client: redis.Redis,
) -> None:
    for i in range(200):
        enqueue(client, f"a{i}", key="A")
    assert fetch(client, 3) == ["a0", "a1", "a2"]
    for i in range(5):
        enqueue(client, f"b{i}", key="B")
    taken = [fetch(client, 1)[0] for _ in range(10)]
    # B's first turn is the next turn: it ties with A's next one, and waits one A job.
    assert "".join(t[0] for t in taken) == "ababababab"
    assert [t for t in taken if t[0] == "b"] == [f"b{i}" for i in range(5)], "FIFO per key"
    (found,) = backlog.read_backlog(client, [Q])
    assert found.depth == 200 - 3 - 5


def test_the_plain_list_and_the_fair_lane_take_turns(client: redis.Redis) -> None:
    for i in range(3):
        enqueue(client, f"p{i}")
        enqueue(client, f"k{i}", key=f"t{i}")
    assert "".join(t[0] for t in fetch(client, 6)) in ("pkpkpk", "kpkpkp")


def test_a_key_at_its_limit_is_passed_over_and_counted(client: redis.Redis) -> None:
    for i in range(4):
        enqueue(client, f"a{i}", key="A")
    enqueue(client, "b0", key="B")
    admission, got = fetch_reply(client, 4, limit=1)
    assert sorted(got) == ["a0", "b0"]
    assert admission.reason == layout.KEY and admission.deferred >= 1
    assert fetch_reply(client, 4, limit=1)[1] == [], "A still has one in flight"
    script = client.register_script(layout.SETTLE)
    keys = layout.settle_keys("w", Q, Q, ())
    raw = script(
        keys=keys, args=layout.settle_args(("ack", "a0", "", ""), "w", 4, "", Q, (), 0, 10, 1)
    )
    assert [i for i, _ in layout.taken(raw, head=1)[1]] == ["a1"], "the ack frees A's turn"
    assert layout.requeue_held(client, "w", Q, "a1")
    assert fetch(client, 4, limit=1) == ["a2"], "a requeue frees A's turn: a1 waits last"


def test_a_key_past_its_rate_is_passed_over_until_its_next_start_is_due(
    client: redis.Redis,
) -> None:
    """GCRA per key: a burst of 2, then one start per 500 ms (2/s); B's keys are not held
    by A's rate; the wait the fetch returns is the time to A's next start; a key whose
    next start is past is dropped from the zset (its bucket is full: as if absent)."""
    for i in range(6):
        enqueue(client, f"a{i}", key="A")
    enqueue(client, "b0", key="B")
    enqueue(client, "b1", key="B")
    rate = layout.KeyRate(2.0, 2)
    admission, got = fetch_reply(client, 10, rate=rate)
    assert sorted(got) == ["a0", "a1", "b0", "b1"], "each key's burst, taken in turns"
    assert admission.reason == layout.KEY and admission.deferred == 4
    assert 400 < admission.wait_ms <= 500, admission
    assert fetch(client, 10, rate=rate) == [], "A's next start is not due"
    assert fetch(client, 1) == ["a2"], "the same queue without a rate: no hold"
    time.sleep(admission.wait_ms / 1000 + 0.05)
    assert fetch(client, 10, rate=rate) == ["a3"], "one start per 500 ms once the burst is used"
    admission, got = fetch_reply(client, 10, rate=rate)
    assert got == [] and 400 < admission.wait_ms <= 500, admission
    next_start = layout.fair_keys(Q)[6]
    assert client.zscore(next_start, "B") is not None
    time.sleep(1.1)
    assert fetch(client, 10, rate=rate) == ["a4", "a5"], "a quiet second refills the burst"
    assert client.zscore(next_start, "B") is None, "B's full bucket is forgotten"
    assert client.zscore(next_start, "A") is not None


def test_a_fair_key_rate_that_does_not_parse_is_refused_in_one_line(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    try:
        refusals: list[tuple[dict[str, Any], str]] = [
            ({"fair_key_rate": "fast"}, "fair_key_rate 'fast' is not a rate above 0"),
            ({"fair_key_rate": "0/s"}, "fair_key_rate '0/s' is not a rate above 0"),
            ({"fair_key_rate": "5/s", "fair_key_burst": 0}, "fair_key_burst 0 is not a count"),
            ({"fair_key_rate": "5/s", "fair_key_burst": True}, "fair_key_burst True is not a"),
            ({"fair_key_rate": "5/s", "fair_key_burst": "2"}, "fair_key_burst '2' is not a"),
            ({"fair_key_burst": 3}, "fair_key_burst without fair_key_rate"),
            ({"fair_key_limit": 0}, "fair_key_limit 0 is not a count"),
        ]
        for options, said in refusals:
            with pytest.raises(ValueError, match=said) as refused:

                @typed_actor(broker=broker, queue_name=Q, fair_key="tenant_id", **options)
                def report(job: Report) -> None: ...

            assert "\n" not in str(refused.value) and "actor 'report'" in str(refused.value)
        unkeyed: list[dict[str, Any]] = [
            {"fair_key_rate": "5/s"},
            {"fair_key_burst": 3},
            {"fair_key_limit": 2},
        ]
        for options in unkeyed:
            (option,) = options
            with pytest.raises(ValueError, match=f"{option} without fair_key$"):

                @typed_actor(broker=broker, queue_name=Q, **options)
                def without_key(job: Report) -> None: ...

        @typed_actor(broker=broker, queue_name=Q, fair_key="tenant_id", fair_key_rate="300/min")
        def keyed(job: Report) -> None: ...

        assert broker.key_rate(Q) == layout.KeyRate(5.0, 5), "default burst: one second's"

        @typed_actor(
            broker=broker, queue_name=Q, fair_key="tenant_id", fair_key_rate="2/s", fair_key_burst=1
        )
        def slower(job: Report) -> None: ...

        assert broker.key_rate(Q) == layout.KeyRate(2.0, 1), "the lowest of the queue's actors"
        assert broker.key_rate("reports") == layout.NO_KEY_RATE
    finally:
        broker.close()


def test_the_fair_lane_is_seen_by_the_backlog_the_page_and_recovery(client: redis.Redis) -> None:
    now = time.time()
    enqueue(client, "p")
    enqueue(client, "k-old", key="A", sent_ms=int((now - 40) * 1000))
    (found,) = backlog.read_backlog(client, [Q], now=now)
    assert found.depth == 2 and 39 < found.oldest_s < 41, "the fair lane's oldest"
    total, page = layout.waiting_page(client, Q, 0, 10)
    assert total == 2 and [i for i, _ in page] == ["p", "k-old"]
    enqueue(client, "k2", key="B")
    assert sorted(fetch(client, 3)) == ["k-old", "k2", "p"]
    assert layout.requeue_held(client, "w", Q, "k2")
    fair, busy = layout.fair_keys(Q)[0], layout.fair_keys(Q)[4]
    assert client.zscore(fair, "k2") is not None, "recovery puts it back on the fair lane"
    assert client.hget(busy, "B") is None and client.hget(busy, "A") == b"1"
    assert layout.dead_letter_held(client, "w", Q, "k-old", b"{}", "m-k-old")
    assert client.hget(busy, "A") is None, "a dead letter frees its key's count"


class Report(JobArguments):
    tenant_id: str


def test_a_fair_key_the_model_lacks_is_refused_in_one_line(redis_url: str) -> None:
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    try:
        with pytest.raises(ValueError, match="fair_key 'tenant' is not a field") as refused:

            @typed_actor(broker=broker, queue_name=Q, fair_key="tenant")
            def report(job: Report) -> None: ...

        assert "\n" not in str(refused.value)

        @typed_actor(broker=broker, queue_name=Q, fair_key="tenant_id", fair_key_limit=2)
        def keyed(job: Report) -> None: ...

        sent = broker.enqueue(keyed.message("t-7"))
        assert sent.options[layout.FAIRNESS_KEY_OPTION] == "t-7"
        assert broker.key_limit(Q) == 2
    finally:
        broker.close()


def test_a_keyed_job_of_another_priority_is_refused_in_one_line_and_nothing_is_stored(
    redis_url: str, client: redis.Redis
) -> None:
    """Keys take turns on the default lane only: a high or low lane would have run a keyed
    job with neither its turn nor its key's limit (the key was dropped, silently)."""
    broker = SettlingRedisBroker(url=redis_url, middleware=[])
    try:
        with pytest.raises(layout.PriorityError, match="keyed") as refused:

            @typed_actor(broker=broker, queue_name=Q, fair_key="tenant_id", priority_lane="high")
            def urgent(job: Report) -> None: ...

        assert "\n" not in str(refused.value) and "'high'" in str(refused.value)

        @typed_actor(broker=broker, queue_name=Q, fair_key="tenant_id", fair_key_limit=1)
        def keyed(job: Report) -> None: ...

        for priority in ("high", "low"):
            with pytest.raises(layout.PriorityError, match="keys take turns") as refused:
                keyed.send_with_options(args=("t-1",), priority=priority)
            assert "\n" not in str(refused.value)
        assert not any(client.scan_iter(f"{layout.queue_key(Q)}*")), "nothing stored"
        sent = keyed.send_with_options(args=("t-1",), priority="normal")
        assert sent.options[layout.FAIRNESS_KEY_OPTION] == "t-1"
    finally:
        broker.close()
