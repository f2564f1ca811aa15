"""Schedules (pools.toml ``[schedules.*]``): the model and tick arithmetic (:mod:`.schedules`),
the leader loop (:mod:`.loop`) apart from the commands (:mod:`.cli`)."""
