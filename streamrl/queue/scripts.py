"""Lua scripts the queue runs inside Redis: each one is atomic, so what it checks still holds when it writes.

They are sent with EVAL (not EVALSHA): a restarted server has an empty script cache, and a retried
EVALSHA would fail with NOSCRIPT. Each takes its key names in KEYS (an ACL user scoped to the run's
prefix may run them) and is safe to run twice, as a retry after a lost reply does.

No payload passes through a script: a producer XADDs its groups itself, in a MULTI/EXEC transaction that ends
with ADMIT, which keeps the entries it admits and deletes the others before anything else runs. (A payload
passed to a script is copied into Lua and back out: the server spent 15-25 µs more per 100 KB group, measured.)

Keys they share (see `stream.QueueKeys`):
- the stream of entries, `{i: group id, g: wire bytes}`;
- the push markers, a hash with a field per group in the stream, set when ADMIT admits it and deleted when the
  group is retired (trained on or dropped): while a group is in the stream, or once it is in the trained set,
  ADMIT refuses another copy of it; so every entry a producer wrote is the only one of its group and was never
  trained on (a dead-lettered group keeps its marker: bytes that failed to decode are not admitted again under its
  id). One hash rather than a key per group: each script takes a fixed set of keys, and reads or writes the
  markers of all its groups in one command (as fast as a key per group, measured).
  A marker's value is longer than `hash-max-ziplist-value` (64 bytes by default; `hash-max-listpack-value` since Redis
  7), which keeps the hash a hash table: as a ziplist (up to 512 fields by default) every HMGET, HSET and HDEL scans
  all its fields: with a backlog of 256 groups, over a third of the scripts' server time (perf, 1k groups);
- the trained set of group ids;
- the claims hash: places in the backlog reserved by a producer (CLAIM) for its next push, so that producers
  pushing into a nearly full backlog send only payloads that fit (each claim expires: a producer that dies
  holding one costs the others a wait, never a place);
- the room baton, a list holding at most one token, pushed when room is freed (or left over by a push or a claim)
  and popped by a producer waiting for room: waiters wake one at a time. It is only a wake-up, and a waiter also
  looks again after a short timeout, so a token lost with a crashed producer costs a wait, never a group.
"""

# Shared by CLAIM and ADMIT: the server's clock in ms; the places claimed by producers other than `token` (claims past
# their expiry are deleted on the way; a claim is `count:expiry_ms` under the claimant's token in the claims hash); and
# whether each group was pushed before (it has a marker: it is in the stream; or it is in the trained set).
_PRELUDE = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function claimed_by_others(claims, token)
  local fields = redis.call('HGETALL', claims)
  local total = 0
  for i = 1, #fields, 2 do
    local count, expiry = string.match(fields[i + 1], '^(%d+):(%d+)$')
    if not expiry or tonumber(expiry) <= now then
      redis.call('HDEL', claims, fields[i])
    elseif fields[i] ~= token then
      total = total + tonumber(count)
    end
  end
  return total
end
-- For the group ids ARGV[from..]: whether each was pushed before, in a table indexed from 1. Lua's unpack is limited
-- by its stack: at most 1000 ids a command.
local function pushed_before(markers, trained, from)
  local before = {}
  for first = from, #ARGV, 1000 do
    local last = math.min(first + 999, #ARGV)
    local marked = redis.call('HMGET', markers, unpack(ARGV, first, last))
    local was_trained = redis.call('SMISMEMBER', trained, unpack(ARGV, first, last))
    for i = 1, last - first + 1 do
      before[first - from + i] = marked[i] ~= false or was_trained[i] == 1
    end
  end
  return before
end
"""

# KEYS: the stream, the claims hash, the trained set, the push markers, the room baton. ARGV: the producer's token, the
# fewest places worth taking, max backlog, claim TTL in ms, then the id of each group to push. Groups in the stream or
# trained on were pushed before and need no place; for the others it reserves min(their number, room) places for the
# token's next push if that is at least the fewest worth taking (lowered to their number), replacing any claim the
# token had (room: the backlog bound less the stream's length and the live claims of other producers); room left over
# goes on to the next waiting producer through the baton. Returns the places reserved (0: none; the caller waits for
# the baton), then 1 for each group pushed before, else 0.
CLAIM = (
    _PRELUDE
    + """
local replies = {0}
local wanted = 0
for i, before in ipairs(pushed_before(KEYS[4], KEYS[3], 5)) do
  replies[i + 1] = before and 1 or 0
  if not before then
    wanted = wanted + 1
  end
end
local room = tonumber(ARGV[3]) - redis.call('XLEN', KEYS[1]) - claimed_by_others(KEYS[2], ARGV[1])
local grant = math.min(wanted, room)
if grant <= 0 or grant < math.min(tonumber(ARGV[2]), wanted) then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return replies
end
redis.call('HSET', KEYS[2], ARGV[1], grant .. ':' .. (now + tonumber(ARGV[4])))
if room > grant and redis.call('LLEN', KEYS[5]) == 0 then
  redis.call('RPUSH', KEYS[5], 1)
end
replies[1] = grant
return replies
"""
)

# KEYS: the stream, the trained set, the claims hash, the room baton, the push markers. ARGV: the producer's token, max
# backlog, then the id of each group. Runs last in the producer's MULTI/EXEC transaction, right after its XADDs of
# those groups, in order: they are the stream's newest entries. Admits each group in order while there is room (the
# bound less the stream's length before the XADDs and the live claims of other producers), unless it was pushed
# before (it has a marker or was trained on: a retried or repeated push, or a group listed twice whose first copy was
# admitted); marks each one admitted and deletes the entries of the others (a rare path: reading the entries back
# copies their payloads). The token's own claim shrinks by the groups admitted. Returns one reply per group: 1
# admitted, 2 pushed before, 0 refused for want of room; then the room left, which, if any, is passed on to the next
# waiting producer through the baton. Nothing else runs inside the transaction, so the bound is exact.
ADMIT = (
    _PRELUDE
    + """
local n = #ARGV - 2
local room = tonumber(ARGV[2]) - (redis.call('XLEN', KEYS[1]) - n) - claimed_by_others(KEYS[3], ARGV[1])
local before = pushed_before(KEYS[5], KEYS[2], 3)
local replies, marked, marks = {}, {}, {}
local mark = string.rep('m', 65)  -- longer than hash-max-ziplist-value: see the module docstring
for i = 1, n do
  local group_id = ARGV[2 + i]
  if before[i] or marked[group_id] then
    replies[i] = 2
  elseif room > 0 then
    room = room - 1
    marked[group_id] = true
    marks[#marks + 1] = group_id
    marks[#marks + 1] = mark
    replies[i] = 1
  else
    replies[i] = 0
  end
end
for first = 1, #marks, 1000 do
  redis.call('HSET', KEYS[5], unpack(marks, first, math.min(first + 999, #marks)))
end
local admitted = #marks / 2
if admitted < n then
  local entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', n)
  for i = 1, n do
    if replies[i] ~= 1 then
      redis.call('XDEL', KEYS[1], entries[n + 1 - i][1])
    end
  end
end
local own = redis.call('HGET', KEYS[3], ARGV[1])
if own then
  local count, expiry = string.match(own, '^(%d+):(%d+)$')
  if count and tonumber(count) > admitted then
    redis.call('HSET', KEYS[3], ARGV[1], (tonumber(count) - admitted) .. ':' .. expiry)
  else
    redis.call('HDEL', KEYS[3], ARGV[1])
  end
end
if room > 0 and redis.call('LLEN', KEYS[4]) == 0 then
  redis.call('RPUSH', KEYS[4], 1)
end
replies[n + 1] = room
return replies
"""
)

# KEYS: the stream, the trained set, the room baton, the push markers. ARGV: consumer group, 1 to record the groups as
# trained (0 when dropping), number n of entries, their n ids, then the ids of the groups retired (none for entries
# skipped as copies: the marker is the other copy's). Acks and deletes the entries, deletes the groups' markers and
# records them in one step: a group is never acked without being recorded, and a push of it is refused (by its
# marker, then by the trained set) at all times. The room it frees wakes one waiting producer (the baton). At most
# 1000 ids a command (Lua's unpack is limited by its stack). Returns the stream's length after (a hint for the
# consumer's read-ahead).
RETIRE = """
local n = tonumber(ARGV[3])
for first = 4, n + 3, 1000 do
  local last = math.min(first + 999, n + 3)
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, last))
  redis.call('XDEL', KEYS[1], unpack(ARGV, first, last))
end
for first = n + 4, #ARGV, 1000 do
  local last = math.min(first + 999, #ARGV)
  redis.call('HDEL', KEYS[4], unpack(ARGV, first, last))
  if ARGV[2] == '1' then
    redis.call('SADD', KEYS[2], unpack(ARGV, first, last))
  end
end
if n > 0 and redis.call('LLEN', KEYS[3]) == 0 then
  redis.call('RPUSH', KEYS[3], 1)
end
return redis.call('XLEN', KEYS[1])
"""
