"""Dead letters: the store (:mod:`.store`) and the ``dlq`` commands (:mod:`.cli`)."""
