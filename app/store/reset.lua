-- DELETE /cache on any replica (app/store/redis_shared.py): a new epoch and an empty log.
-- Every replica that next meets the new epoch rebuilds its mirror from the (empty) log.
--
-- KEYS[1]  the log   KEYS[2]  the memory's hash   KEYS[3]  the published graph's description
-- ARGV[1]  capacity   ARGV[2]  TTL in ms ('0': none)   ARGV[3]  model identity ('': none)
-- ARGV[4]  the graph chunks' key prefix (graph_publish.lua)
-- These settings become the memory's (the way to change them for every replica). The
-- published graph goes too: it indexes entries that are gone.
--
-- Returns {epoch, now_ms, live entries dropped}.
local log, meta = KEYS[1], KEYS[2]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local live = 0
local state = redis.call('HMGET', meta, 'epoch', 'ttl_ms')
if state[1] then
  local ttl = tonumber(state[2]) or 0
  if ttl > 0 then
    redis.call('XTRIM', log, 'MINID', string.format('%d', math.floor(now - ttl) + 1))
  end
  live = redis.call('XLEN', log)
end

local epoch = redis.call('HINCRBY', meta, 'generation', 1) .. '@' .. time[1] .. '.' .. time[2]
redis.call('DEL', log)
local graph = redis.call('HMGET', KEYS[3], 'token', 'chunks')
if graph[1] and graph[2] then
  for i = 0, tonumber(graph[2]) - 1 do
    redis.call('DEL', ARGV[4] .. graph[1] .. ':' .. i)
  end
end
redis.call('DEL', KEYS[3])
redis.call('HSET', meta, 'epoch', epoch, 'capacity', ARGV[1], 'ttl_ms', ARGV[2], 'model', ARGV[3])
return {epoch, now, live}
