"""Lua scripts the queue runs inside Redis: each one is atomic, so what it checks still holds when it writes.

They are sent with EVAL (not EVALSHA): a restarted server has an empty script cache, and a retried
EVALSHA would fail with NOSCRIPT. Each takes its key names in KEYS (an ACL user scoped to the run's
prefix may run them) and is safe to run twice, as a retry after a lost reply does.

Keys they share (see `stream.QueueKeys`):
- the stream of entries: `{g: wire bytes}` for a small group, `{i: group id, n: push nonce}` for a large one,
  whose bytes are a payload key of their own, written by a plain SET (Redis keeps the received buffer as it
  is; a payload passed through a script is copied into Lua and back and logged to the AOF as the script's
  effect: about twice the server's time of the SET for 1.5 MB, measured);
- `entry_groups`, a hash from the id of each entry appended by PUSH to its group id, which lets CHECK look up
  groups without reading their payloads;
- the trained set of group ids; one push marker per group (the entry id it was appended as);
- the claims hash: places in the backlog reserved by a producer (CLAIM) for its next PUSH, so that producers
  pushing into a nearly full backlog send only payloads that fit (each claim expires: a producer that dies
  holding one costs the others a wait, never a place);
- the room baton, a list holding at most one token, pushed when room is freed (or left over by a push) and
  popped by a producer waiting for room: waiters wake one at a time. It is only a wake-up, and a waiter also
  looks again after a short timeout, so a token lost with a crashed producer costs a wait, never a group.
"""

# Shared by CLAIM and PUSH: the server's clock in ms, and the places claimed by producers other than `token` (claims
# past their expiry are deleted on the way). A claim is `count:expiry_ms` under the claimant's token in the claims hash.
_CLAIMS = """
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
"""

# KEYS: the stream, the claims hash, then the push marker of each group to push. ARGV: the producer's token, the fewest
# places worth taking, max backlog, claim TTL in ms. Groups whose marker exists were pushed before and need no place;
# for the others it reserves min(their number, room) places for the token's next PUSH if that is at least the fewest
# worth taking (lowered to their number), replacing any claim the token had (room: the backlog bound less the stream's
# length and the live claims of other producers). Returns the places reserved (0: none; the caller waits for the
# baton), then the entry id of each group pushed before, or 0.
CLAIM = _CLAIMS + """
local replies = {0}
local wanted = 0
for i = 3, #KEYS do
  local entry_id = redis.call('GET', KEYS[i])
  replies[i - 1] = entry_id or 0
  if not entry_id then
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
replies[1] = grant
return replies
"""

# KEYS: the stream, entry_groups, the room baton, the claims hash, then the push marker of each group, then its payload
# key. ARGV: the producer's token, marker TTL in ms, max backlog, the push's nonce, then the id of each group, then its
# wire bytes, or "" for a group whose bytes the producer SET under its payload key just before (with an expiry, so
# that a producer dying in between leaves no garbage). Appends the groups in order while there is room (the bound less
# the stream's length and the live claims of other producers): `{g: bytes}`, or `{i: group id, n: nonce}` with the
# payload key made permanent. The token's own claim shrinks by the groups appended, so the later calls of a push split
# in several keep the rest of it. A group whose marker exists was pushed before and keeps its entry; this push's
# payload key is then deleted unless that entry is this same push's (a retried call). A group refused for want of room
# has its payload key deleted. Returns one reply per group: its entry id, or 0 if there was no room; then the room
# left. Nothing else appends while the script runs, so counting the room down from one XLEN keeps the bound exact.
# Room left over is passed on to the next waiting producer through the baton. Refuses the whole call, before any
# write, if a payload key it was told about is missing.
PUSH = _CLAIMS + """
local n = (#KEYS - 4) / 2
local nonce = ARGV[4]
for i = 1, n do
  if ARGV[4 + n + i] == '' and redis.call('EXISTS', KEYS[4 + n + i]) == 0 then
    return redis.error_reply('payload of group ' .. ARGV[4 + i] .. ' missing at ' .. KEYS[4 + n + i])
  end
end
local room = tonumber(ARGV[3]) - redis.call('XLEN', KEYS[1]) - claimed_by_others(KEYS[4], ARGV[1])
local replies = {}
local appended = 0
for i = 1, n do
  local entry_id = redis.call('GET', KEYS[4 + i])
  local stored = ARGV[4 + n + i] == ''
  if entry_id then
    if stored then
      local entry = redis.call('XRANGE', KEYS[1], entry_id, entry_id)
      local same = false
      if #entry == 1 then
        local fields = entry[1][2]
        for f = 1, #fields, 2 do
          if fields[f] == 'n' and fields[f + 1] == nonce then
            same = true
          end
        end
      end
      if not same then
        redis.call('DEL', KEYS[4 + n + i])
      end
    end
  elseif room > 0 then
    if stored then
      redis.call('PERSIST', KEYS[4 + n + i])
      entry_id = redis.call('XADD', KEYS[1], '*', 'i', ARGV[4 + i], 'n', nonce)
    else
      entry_id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[4 + n + i])
    end
    redis.call('SET', KEYS[4 + i], entry_id, 'PX', ARGV[2])
    redis.call('HSET', KEYS[2], entry_id, ARGV[4 + i])
    room = room - 1
    appended = appended + 1
  elseif stored then
    redis.call('DEL', KEYS[4 + n + i])
  end
  replies[i] = entry_id or 0
end
local own = redis.call('HGET', KEYS[4], ARGV[1])
if own then
  local count, expiry = string.match(own, '^(%d+):(%d+)$')
  if count and tonumber(count) > appended then
    redis.call('HSET', KEYS[4], ARGV[1], (tonumber(count) - appended) .. ':' .. expiry)
  else
    redis.call('HDEL', KEYS[4], ARGV[1])
  end
end
if room > 0 and redis.call('LLEN', KEYS[3]) == 0 then
  redis.call('RPUSH', KEYS[3], 1)
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

# KEYS: the stream, the trained set, entry_groups, the room baton, then the payload keys of the entries (those stored
# apart). ARGV: consumer group, number n of entries, their n ids, then the group ids to record as trained (none when
# dropping). Acks and deletes the entries (their entry_groups fields and payload keys too) and records the group ids in
# one step: a group is never acked without being recorded. The room it frees wakes one waiting producer (the baton). At
# most 1000 ids a command (Lua's unpack is limited by its stack). Returns the stream's length after (a hint for the
# consumer's read-ahead).
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
for first = 5, #KEYS, 1000 do
  redis.call('DEL', unpack(KEYS, first, math.min(first + 999, #KEYS)))
end
if n > 0 and redis.call('LLEN', KEYS[4]) == 0 then
  redis.call('RPUSH', KEYS[4], 1)
end
return redis.call('XLEN', KEYS[1])
"""
