-- POST /cache/import into the shared novelty memory (app/store/redis_shared.py): entries
-- appended in order as the newest, each keeping its own time where the order allows.
--
-- KEYS[1]  the log   KEYS[2]  the memory's hash
-- ARGV[1]  capacity   ARGV[2]  TTL in ms ('0': none)   ARGV[3]  model identity ('': none)
-- ARGV[4..] trace id, added_at_ms, vector (float32 bytes): one triple per entry, in order
--
-- An entry already past the TTL is skipped. An entry's id is its time in ms, raised to the
-- log's last id (ids only grow) and lowered to now (an entry from the future would outlive
-- its TTL). Returns {'ok', appended, skipped}, or {'settings_mismatch', why} as exchange.lua.
local log, meta = KEYS[1], KEYS[2]
local capacity, ttl, model = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local state = redis.call('HMGET', meta, 'epoch', 'capacity', 'ttl_ms', 'model')
if not state[1] then
  local epoch = redis.call('HINCRBY', meta, 'generation', 1) .. '@' .. time[1] .. '.' .. time[2]
  redis.call('DEL', log)
  redis.call('HSET', meta, 'epoch', epoch, 'capacity', ARGV[1], 'ttl_ms', ARGV[2], 'model', model)
else
  if tonumber(state[2]) ~= capacity or tonumber(state[3]) ~= ttl then
    return {'settings_mismatch', 'the shared cache has KP_CACHE_CAPACITY=' .. state[2] ..
      ' and KP_CACHE_TTL_MS=' .. state[3] .. ' (0: unset), this replica ' .. ARGV[1] ..
      ' and ' .. ARGV[2]}
  end
  if model ~= '' and state[4] and state[4] ~= '' and state[4] ~= model then
    return {'settings_mismatch', 'the shared cache holds vectors of ' .. state[4] ..
      ', this replica makes them with ' .. model}
  end
end

if ttl > 0 then
  redis.call('XTRIM', log, 'MINID', string.format('%d', math.floor(now - ttl) + 1))
end

local last_ms = 0
if redis.call('EXISTS', log) == 1 then
  local info = redis.call('XINFO', 'STREAM', log)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      last_ms = tonumber(string.match(info[i + 1], '^(%d+)'))
    end
  end
end

local appended, skipped = 0, 0
local before = redis.call('XLEN', log)
for i = 4, #ARGV, 3 do
  local ms = math.floor(tonumber(ARGV[i + 1]))
  if ttl > 0 and ms <= now - ttl then
    skipped = skipped + 1
  else
    if ms > now then ms = now end
    if ms < last_ms then ms = last_ms end
    redis.call('XADD', log, 'MAXLEN', ARGV[1], string.format('%d', ms) .. '-*',
      'trace', ARGV[i], 'v', ARGV[i + 2])
    last_ms = ms
    appended = appended + 1
  end
end
if appended > 0 then
  redis.call('HINCRBY', meta, 'adds', appended)
  local evicted = before + appended - capacity
  if evicted > 0 then
    redis.call('HINCRBY', meta, 'evictions', math.min(evicted, appended))
  end
end
return {'ok', appended, skipped}
