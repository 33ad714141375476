-- DELETE /cache on any replica (app/store/redis_shared.py): a new epoch and an empty log.
-- Every replica that next meets the new epoch rebuilds its mirror from the (empty) log.
--
-- KEYS[1]  the log   KEYS[2]  the memory's hash
-- ARGV[1]  capacity   ARGV[2]  TTL in ms ('0': none)   ARGV[3]  model identity ('': none)
-- These settings become the memory's (the way to change them for every replica).
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
redis.call('HSET', meta, 'epoch', epoch, 'capacity', ARGV[1], 'ttl_ms', ARGV[2], 'model', ARGV[3])
return {epoch, now, live}
