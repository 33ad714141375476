-- A replica publishes the graph it built for the others (app/store/redis_graph.py), once its
-- chunks are written: the description is swapped in and the previous graph's chunks deleted,
-- in one step, unless this replica lost its lease or the memory was reset meanwhile.
--
-- KEYS[1]  the graph's description (a hash)   KEYS[2]  the publisher's lease
-- KEYS[3]  the memory's hash (its epoch)
-- ARGV[1]  this publisher's token   ARGV[2]  the epoch the graph was built in
-- ARGV[3]  the chunks' key prefix (a chunk is <ARGV[3]><token>:<i>)
-- ARGV[4..] field, value pairs of the new description (token and chunks among them)
--
-- Returns 'ok', 'lost_lease' or 'stale' (the caller then deletes its own chunks).
local described, lease, meta = KEYS[1], KEYS[2], KEYS[3]
if redis.call('GET', lease) ~= ARGV[1] then
  return 'lost_lease'
end
if redis.call('HGET', meta, 'epoch') ~= ARGV[2] then
  redis.call('DEL', lease)
  return 'stale'
end
local old = redis.call('HMGET', described, 'token', 'chunks')
if old[1] and old[2] then
  for i = 0, tonumber(old[2]) - 1 do
    redis.call('DEL', ARGV[3] .. old[1] .. ':' .. i)
  end
end
redis.call('DEL', described)
local fields = {}
for i = 4, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('HSET', described, unpack(fields))
redis.call('DEL', lease)
return 'ok'
