-- One replica's turn at the shared novelty memory (app/store/redis_shared.py). Redis runs a
-- script alone, so each run is one step of the single order every replica follows.
--
-- KEYS[1]  the log: a stream; an entry's id is its place in the order and Redis's clock (ms)
-- KEYS[2]  the memory's hash: epoch, capacity, ttl_ms, model, counters
-- ARGV[1]  the epoch this replica knows ('' at first)   ARGV[2]  the last log id it has seen
-- ARGV[3]  capacity   ARGV[4]  TTL in ms ('0': none)   ARGV[5]  model identity ('': none)
-- ARGV[6]  the most entries to return (a page)
-- ARGV[7..] trace id, vector (float32 bytes): one pair for each vector to append, in order
--
-- Returns {'ok', epoch, now_ms, full, entries, appended_ids, adds_total, evictions_total,
-- more, length}: the entries added since ARGV[2] (from the start when `full` is 1: an epoch
-- this replica does not know), all of them before this run's own entries in the order.
-- `more` is 1 when more entries than a page wait: then nothing is appended (the replica is
-- not caught up; it asks again from the page's last id). `length`: entries in the log. Or,
-- changing nothing, {'settings_mismatch', why} when this replica's settings differ from the
-- memory's (a reply, not an error, so Python tells it from Redis's own errors without
-- reading the text).
local log, meta = KEYS[1], KEYS[2]
local capacity, ttl, model = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local state = redis.call('HMGET', meta, 'epoch', 'capacity', 'ttl_ms', 'model')
local epoch = state[1]
if not epoch then
  -- A new memory: first use, or its keys are gone (FLUSHALL, Redis restarted without its data).
  epoch = redis.call('HINCRBY', meta, 'generation', 1) .. '@' .. time[1] .. '.' .. time[2]
  redis.call('DEL', log)
  redis.call('HSET', meta, 'epoch', epoch, 'capacity', ARGV[3], 'ttl_ms', ARGV[4], 'model', model)
else
  if tonumber(state[2]) ~= capacity or tonumber(state[3]) ~= ttl then
    return {'settings_mismatch', 'the shared cache has KP_CACHE_CAPACITY=' .. state[2] ..
      ' and KP_CACHE_TTL_MS=' .. state[3] .. ' (0: unset), this replica ' .. ARGV[3] ..
      ' and ' .. ARGV[4]}
  end
  if model ~= '' then
    if not state[4] or state[4] == '' then
      redis.call('HSET', meta, 'model', model)
    elseif state[4] ~= model then
      return {'settings_mismatch', 'the shared cache holds vectors of ' .. state[4] ..
        ', this replica makes them with ' .. model}
    end
  end
end

-- Entries added at or before now - ttl have expired (the reference keeps addedAt > cutoff).
if ttl > 0 then
  redis.call('XTRIM', log, 'MINID', string.format('%d', math.floor(now - ttl) + 1))
end

local page = tonumber(ARGV[6])
local full, entries = 0, nil
if epoch ~= ARGV[1] then
  full = 1
  entries = redis.call('XRANGE', log, '-', '+', 'COUNT', page + 1)
else
  entries = redis.call('XRANGE', log, '(' .. ARGV[2], '+', 'COUNT', page + 1)
end
local more = 0
if #entries > page then
  more = 1
  entries[#entries] = nil
end

local ids = {}
local appending = (#ARGV - 6) / 2
if more == 1 then
  appending = 0
end
if appending > 0 then
  local before = redis.call('XLEN', log)
  for i = 1, appending do
    ids[i] = redis.call('XADD', log, 'MAXLEN', ARGV[3], '*',
      'trace', ARGV[5 + 2 * i], 'v', ARGV[6 + 2 * i])
  end
  redis.call('HINCRBY', meta, 'adds', appending)
  local evicted = before + appending - capacity
  if evicted > 0 then
    redis.call('HINCRBY', meta, 'evictions', evicted)
  end
end

local counters = redis.call('HMGET', meta, 'adds', 'evictions')
return {'ok', epoch, now, full, entries, ids, tonumber(counters[1] or 0),
  tonumber(counters[2] or 0), more, redis.call('XLEN', log)}
