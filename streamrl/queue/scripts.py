"""Lua scripts the queue runs inside Redis: each one is atomic, so what it checks still holds when it writes.

They are sent with EVAL (not EVALSHA): a restarted server has an empty script cache, and a retried
EVALSHA would fail with NOSCRIPT. Each takes its key names in KEYS (an ACL user scoped to the run's
prefix may run them) and is safe to run twice, as a retry after a lost reply does.

Keys they share (see `stream.QueueKeys`): the stream of entries `{g: wire bytes}`; `entry_groups`, a
hash from the id of each entry appended by PUSH to its group id, which lets CHECK look up groups
without reading their payloads; the trained set of group ids; one push marker per group (the entry id
it was appended as).
"""

# KEYS: the stream, entry_groups, then the push marker of each group. ARGV: marker TTL in ms, max backlog, then the
# id of each group, then its wire bytes. Appends the groups in order while the backlog has room; a group whose marker
# exists was pushed before and keeps its entry. Returns one reply per group: its entry id, or 0 if the backlog was
# full; then the room left. Nothing else appends while the script runs, so counting the room down from one XLEN keeps
# the bound exact.
PUSH = """
local n = #KEYS - 2
local room = tonumber(ARGV[2]) - redis.call('XLEN', KEYS[1])
local replies = {}
for i = 1, n do
  local entry_id = redis.call('GET', KEYS[2 + i])
  if not entry_id and room > 0 then
    entry_id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[2 + n + i])
    redis.call('SET', KEYS[2 + i], entry_id, 'PX', ARGV[1])
    redis.call('HSET', KEYS[2], entry_id, ARGV[2 + i])
    room = room - 1
  end
  replies[i] = entry_id or 0
end
replies[n + 1] = room
return replies
"""

# KEYS: the stream, entry_groups, the trained set. ARGV: consumer group, consumer, first entry id, count. Runs right
# after the consumer's XREADGROUP in the same round trip. For each entry pending for the consumer from the first id on
# (at most count) that PUSH appended: its id, then 1 if its group is in the trained set, else 0 (a flat list). Stream
# entries never change, so the group PUSH recorded for an entry is the one in its payload. Entries appended otherwise
# are not in entry_groups: the caller checks those itself.
CHECK = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], '+', ARGV[4], ARGV[2])
local replies = {}
for _, entry in ipairs(pending) do
  local group_id = redis.call('HGET', KEYS[2], entry[1])
  if group_id then
    replies[#replies + 1] = entry[1]
    replies[#replies + 1] = redis.call('SISMEMBER', KEYS[3], group_id)
  end
end
return replies
"""

# KEYS: the stream, the trained set, entry_groups. ARGV: consumer group, number n of entries, their n ids, then the
# group ids to record as trained (none when dropping). Acks and deletes the entries (and their entry_groups fields)
# and records the group ids in one step: a group is never acked without being recorded. At most 1000 ids a command
# (Lua's unpack is limited by its stack). Returns the stream's length after (a hint for the consumer's read-ahead).
RETIRE = """
local n = tonumber(ARGV[2])
for first = 3, n + 2, 1000 do
  local last = math.min(first + 999, n + 2)
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, last))
  redis.call('XDEL', KEYS[1], unpack(ARGV, first, last))
  redis.call('HDEL', KEYS[3], unpack(ARGV, first, last))
end
for first = n + 3, #ARGV, 1000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
return redis.call('XLEN', KEYS[1])
"""
