"""Dead letters: the store and the ``dlq`` commands (:mod:`.store`)."""
