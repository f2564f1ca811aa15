"""Schedules (pools.toml ``[schedules.*]``): the model and tick arithmetic (:mod:`.schedules`),
the leader loop and its commands (:mod:`.loop`)."""
