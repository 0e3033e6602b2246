"""Key schema and Lua scripts of the Redis prefix directory.

Every key of one directory starts with ``ps:{<namespace>}:``; the braces are a
Redis Cluster hash tag, so all keys of a namespace live on one shard and the
scripts below (which build key names from the namespace prefix) touch a single
node. Several models or clusters share one Redis under different namespaces.

    ps:{ns}:replicas          SET   replica ids ever registered and not yet gc'ed
    ps:{ns}:rep:<replica>     HASH  epoch, seq, contract  TTL = liveness (heartbeats);
                                    contract: cluster.shared.contract (may be empty)
    ps:{ns}:blk:<replica>     SET   16-byte block hashes the replica caches now
                                    (same TTL as rep:, refreshed together)
    ps:{ns}:stats:<replica>   HASH  load figures the replica sends with each
                                    heartbeat (num_running, num_waiting,
                                    kv_cache_usage, num_cached_blocks); same TTL
    ps:{ns}:metrics:<replica> STRING the replica's Prometheus exposition text,
                                    replaced every heartbeat; same TTL
    ps:{ns}:tmp:<replica>:<epoch>  SET  staging area of a running resync
    ps:{ns}:events            STREAM every change above, in the order applied
                                    (fields: t = reg | pub | gap | sync | leave,
                                    r = replica, e = epoch, s = seq, c = cleared
                                    or contract, rm / st = removed / stored
                                    hashes, concatenated); trimmed to about
                                    STREAM_MAXLEN entries. Routers follow it
                                    into a local index (directory/follower.py).

``seq`` is the last applied KV event batch, or -1 when the replica must
resync (just registered, or a gap was seen) -- its ``blk:`` set is then empty.
Why these choices (and what they cost) is in docs/DIRECTORY.md.

Lua here is Redis' Lua 5.1: ``unpack`` takes at most a few thousand values, so
long argument lists are applied in chunks of ``CHUNK`` hashes.
"""

from __future__ import annotations

CHUNK = 1000  # hashes per SADD / SREM / SMISMEMBER call inside a script
STREAM_MAXLEN = 20000  # event batches kept for routers that fall behind (then they snapshot)

# Replies of the write scripts (bulk strings).
OK = "ok"
GAP = "gap"
NEEDS_RESYNC = "needs_resync"
UNKNOWN = "unknown"
SUPERSEDED = "superseded"


def key_prefix(namespace: str) -> str:
    """Returns ``ps:{namespace}:`` (validated: the hash tag must stay intact)."""
    if not namespace or any(c in namespace for c in "{}\n\r "):
        raise ValueError(f"namespace must be non-empty without braces, spaces or newlines, got {namespace!r}")
    return f"ps:{{{namespace}}}:"


def check_replica_id(replica_id: str) -> str:
    """Returns ``replica_id`` if it is usable in key names, else raises."""
    if not isinstance(replica_id, str) or not replica_id or "\n" in replica_id:
        raise ValueError(f"replica_id must be a non-empty one-line string, got {replica_id!r}")
    return replica_id


def replicas_key(prefix: str) -> str:
    return prefix + "replicas"


def rep_key(prefix: str, replica_id: str) -> str:
    return prefix + "rep:" + replica_id


def blk_key(prefix: str, replica_id: str) -> str:
    return prefix + "blk:" + replica_id


def stats_key(prefix: str, replica_id: str) -> str:
    return prefix + "stats:" + replica_id


def metrics_key(prefix: str, replica_id: str) -> str:
    return prefix + "metrics:" + replica_id


def tmp_key(prefix: str, replica_id: str, epoch: int) -> str:
    return f"{prefix}tmp:{replica_id}:{epoch}"


def events_key(prefix: str) -> str:
    return prefix + "events"


def exporter_key(prefix: str) -> str:
    return prefix + "metrics-exporter"


# Appends one event to the stream (KEYS index ``ev``), trimmed approximately.
_XADD = f"""
local function xadd(ev, ...)
  redis.call('XADD', ev, 'MAXLEN', '~', '{STREAM_MAXLEN}', '*', ...)
end
"""


# Applies redis.call(cmd, key, ARGV[first..last]) in chunks (unpack limit).
_APPLY = f"""
local function apply(cmd, key, first, last)
  local i = first
  while i <= last do
    local j = math.min(i + {CHUNK} - 1, last)
    redis.call(cmd, key, unpack(ARGV, i, j))
    i = j + 1
  end
end
"""

# Checks the caller's epoch against the registry. Returns nil when current.
_CHECK_EPOCH = f"""
local function check_epoch(rep, epoch)
  local cur = redis.call('HGET', rep, 'epoch')
  if not cur then return '{UNKNOWN}' end
  if cur ~= epoch then return '{SUPERSEDED}' end
  return nil
end
"""

# KEYS: rep, blk, replicas, events   ARGV: replica_id, ttl_ms, contract   -> new epoch (integer)
# The epoch is max(previous + 1, server time in ms): strictly increasing while
# the registry entry lives, and still larger than any earlier epoch after the
# entry expired or Redis restarted empty (no persistence), so a stale process
# can never match a newer registration.
REGISTER = _XADD + """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prev = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
local epoch = math.max(prev + 1, now_ms)
redis.call('UNLINK', KEYS[2])
redis.call('HSET', KEYS[1], 'epoch', string.format('%d', epoch), 'seq', '-1', 'contract', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
xadd(KEYS[4], 't', 'reg', 'r', ARGV[1], 'e', string.format('%d', epoch), 'c', ARGV[3])
return epoch
"""

# KEYS: rep, blk, replicas, stats   ARGV: epoch, ttl_ms, replica_id[, field, value]...
# -> ok | unknown | superseded
# Re-adding the id to the index heals an index lost to eviction (O(1)).
# Field/value pairs replace the replica's stats hash (same TTL as rep:).
HEARTBEAT = (
    _CHECK_EPOCH
    + f"""
local bad = check_epoch(KEYS[1], ARGV[1])
if bad then return bad end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
if #ARGV > 3 then
  redis.call('UNLINK', KEYS[4])
  redis.call('HSET', KEYS[4], unpack(ARGV, 4, #ARGV))
end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
return '{OK}'
"""
)

# KEYS: rep, blk, events
# ARGV: epoch, seq_no, ttl_ms, cleared (0|1), num_removed, replica_id, removed..., stored...
# -> ok | gap | needs_resync | unknown | superseded
# Anything but seq_no == last + 1 (a lost batch, or a batch replayed after an
# ambiguous timeout) empties the set and demands a resync: a set that missed a
# batch may name blocks the replica evicted, and routing must not trust it.
PUBLISH = (
    _APPLY
    + _XADD
    + _CHECK_EPOCH
    + f"""
local bad = check_epoch(KEYS[1], ARGV[1])
if bad then return bad end
local last = tonumber(redis.call('HGET', KEYS[1], 'seq'))
if last < 0 then return '{NEEDS_RESYNC}' end
if tonumber(ARGV[2]) ~= last + 1 then
  redis.call('UNLINK', KEYS[2])
  redis.call('HSET', KEYS[1], 'seq', '-1')
  xadd(KEYS[3], 't', 'gap', 'r', ARGV[6], 'e', ARGV[1])
  return '{GAP}'
end
if ARGV[4] == '1' then redis.call('UNLINK', KEYS[2]) end
local num_removed = tonumber(ARGV[5])
apply('SREM', KEYS[2], 7, 6 + num_removed)
apply('SADD', KEYS[2], 7 + num_removed, #ARGV)
redis.call('HSET', KEYS[1], 'seq', ARGV[2])
xadd(KEYS[3], 't', 'pub', 'r', ARGV[6], 'e', ARGV[1], 's', ARGV[2], 'c', ARGV[4],
     'rm', table.concat(ARGV, '', 7, 6 + num_removed), 'st', table.concat(ARGV, '', 7 + num_removed, #ARGV))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return '{OK}'
"""
)

# KEYS: rep, blk, tmp, events   ARGV: epoch, snapshot_seq_no, ttl_ms, replica_id
# Runs after the client filled ``tmp`` (in the same pipeline): swaps it in
# atomically, so lookups see either the old set or the whole new one.
FINISH_RESYNC = (
    _XADD
    + _CHECK_EPOCH
    + f"""
local bad = check_epoch(KEYS[1], ARGV[1])
if bad then
  redis.call('UNLINK', KEYS[3])
  return bad
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], KEYS[2])
else
  redis.call('UNLINK', KEYS[2])
end
redis.call('HSET', KEYS[1], 'seq', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
xadd(KEYS[4], 't', 'sync', 'r', ARGV[4], 'e', ARGV[1], 's', ARGV[2])
return '{OK}'
"""
)

# KEYS: rep, blk, replicas, stats, metrics, events   ARGV: epoch, replica_id   -> 1 if removed, else 0
DEREGISTER = _XADD + """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
redis.call('SREM', KEYS[3], ARGV[2])
xadd(KEYS[6], 't', 'leave', 'r', ARGV[2], 'e', ARGV[1])
return 1
"""

# KEYS: rep, blk, events   -> {epoch or false, seq, contract, last stream id, {hashes...}}
# One replica's state and blocks, with the stream position they include: a
# follower applies only this replica's later events on top.
SNAPSHOT = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'seq', 'contract')
local last = '0-0'
if redis.call('EXISTS', KEYS[3]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[3])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then last = info[i + 1] end
  end
end
if not cur[1] then return {false, -1, '', last, {}} end
local blocks = {}
if tonumber(cur[2]) >= 0 then blocks = redis.call('SMEMBERS', KEYS[2]) end
return {cur[1], cur[2], cur[3] or '', last, blocks}
"""

# KEYS: replicas   ARGV: prefix   -> flat [replica_id, epoch, seq, ...] of live ones
# A replica whose rep: key expired (no heartbeat for a TTL) is simply absent.
LIVE_REPLICAS = """
local out = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local cur = redis.call('HMGET', ARGV[1] .. 'rep:' .. rid, 'epoch', 'seq')
  if cur[1] then
    out[#out + 1] = rid
    out[#out + 1] = cur[1]
    out[#out + 1] = cur[2]
  end
end
return out
"""

# KEYS: replicas   ARGV: prefix   -> flat [replica_id, {field, value, ...}, ...]
# of live replicas; the inner list is empty before the first stats heartbeat.
REPLICA_STATS = """
local out = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. 'rep:' .. rid) == 1 then
    out[#out + 1] = rid
    out[#out + 1] = redis.call('HGETALL', ARGV[1] .. 'stats:' .. rid)
  end
end
return out
"""

# KEYS: rep, metrics   ARGV: epoch, ttl_ms, text   -> ok | unknown | superseded
# Replaces the replica's metrics text; it expires with the replica's liveness.
PUBLISH_METRICS = (
    _CHECK_EPOCH
    + """
local bad = check_epoch(KEYS[1], ARGV[1])
if bad then return bad end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
return '""" + OK + """'
"""
)

# KEYS: replicas   ARGV: prefix   -> flat [replica_id, text, ...] of live
# replicas that published metrics (a dead replica's text is never returned,
# even before its own key expires).
REPLICA_METRICS = """
local out = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. 'rep:' .. rid) == 1 then
    local text = redis.call('GET', ARGV[1] .. 'metrics:' .. rid)
    if text then
      out[#out + 1] = rid
      out[#out + 1] = text
    end
  end
end
return out
"""

# KEYS: replicas   ARGV: prefix, contract, hash_1, ..., hash_n (a chain, in order)
# -> flat [replica_id, leading_hits, ...] for every live replica; leading_hits
# is -1 for a replica whose declared contract differs from ARGV[2] (both
# non-empty): its blocks are named by another hash chain, so it is not probed.
# Per replica, SMISMEMBER probes the chain in growing windows (4, 8, 16, ...,
# CHUNK) and stops at the first miss, so a cold replica costs one small probe
# and a hit of k blocks costs O(k) membership tests.
LOOKUP = f"""
local prefix = ARGV[1]
local contract = ARGV[2]
local last = #ARGV
local out = {{}}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local cur = redis.call('HMGET', prefix .. 'rep:' .. rid, 'epoch', 'seq', 'contract')
  if cur[1] then
    local hits = 0
    if contract ~= '' and cur[3] and cur[3] ~= '' and cur[3] ~= contract then
      hits = -1
    elseif tonumber(cur[2]) >= 0 then
      local blk = prefix .. 'blk:' .. rid
      local lo, size = 3, 4
      while lo <= last do
        local hi = math.min(lo + size - 1, last)
        local found = redis.call('SMISMEMBER', blk, unpack(ARGV, lo, hi))
        local whole = true
        for i = 1, #found do
          if found[i] == 1 then hits = hits + 1 else whole = false; break end
        end
        if not whole then break end
        lo = hi + 1
        size = math.min(size * 2, {CHUNK})
      end
    end
    out[#out + 1] = rid
    out[#out + 1] = hits
  end
end
return out
"""

# KEYS: replicas   ARGV: prefix   -> replica ids whose entries were dropped
# Entries of a dead replica expire with its rep: key anyway; gc prunes the
# index and unlinks any leftover set (belt and braces for skewed expiry), and
# the events stream once no replica is left.
GC = """
local dropped = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. 'rep:' .. rid) == 0 then
    redis.call('UNLINK', ARGV[1] .. 'blk:' .. rid, ARGV[1] .. 'stats:' .. rid, ARGV[1] .. 'metrics:' .. rid)
    redis.call('SREM', KEYS[1], rid)
    dropped[#dropped + 1] = rid
  end
end
if redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('UNLINK', ARGV[1] .. 'events')  -- no replica left: nothing to follow
end
return dropped
"""

# KEYS: exporter   ARGV: owner, ttl_ms   -> 1 when ``owner`` holds (or now took)
# the lease of exporting the replicas' series, 0 when another router holds it.
CLAIM_EXPORTER = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: exporter   ARGV: owner   -> 1 when ``owner``'s lease was dropped.
RELEASE_EXPORTER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
