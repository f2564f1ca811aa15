"""The message index's Lua (:data:`INDEX`), with which every script that moves a message
keeps the index; :mod:`.lookup` reads it.
"""

from __future__ import annotations

from typing import Final

#: Lua: the message index (:func:`.keys.message_index_key`, message id -> the place of its latest
#: copy, ``"<bodies key> <redis id>"``, :func:`.keys.message_place`). ``keep_place`` records
#: a copy as the latest; ``drop_place`` removes the entry only while it names ``place`` (a
#: later copy's entry stays). Both do nothing for the message id ''.
INDEX: Final = """
local function keep_place(index, message_id, place)
  if message_id ~= '' then redis.call('hset', index, message_id, place) end
end
local function drop_place(index, message_id, place)
  if message_id ~= '' and redis.call('hget', index, message_id) == place then
    redis.call('hdel', index, message_id)
  end
end
"""
