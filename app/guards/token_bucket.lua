-- One request costing ARGV[2] tokens (default 1) against a token bucket that holds ARGV[1]
-- tokens and refills them in a minute.
-- KEYS[1]: the bucket, a hash {tokens, at (microseconds, Redis's clock)}.
-- Returns 0 when the tokens were taken, else the microseconds until they are there.
-- Redis's own clock (TIME) is every replica's clock: the replicas' clocks may disagree.
local capacity = tonumber(ARGV[1])
local cost = tonumber(ARGV[2] or '1')
local per_us = capacity / 60000000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local saved = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(saved[1]) or capacity
local at = tonumber(saved[2]) or now
if now > at then
  tokens = math.min(capacity, tokens + (now - at) * per_us)
end
local wait_us = 0
if tokens >= cost then
  tokens = tokens - cost
else
  wait_us = math.ceil((cost - tokens) / per_us)
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.9f', tokens), 'at', string.format('%.0f', now))
-- A full bucket is what a missing key means: let it go once it would have refilled.
redis.call('PEXPIRE', KEYS[1], 61000)
return wait_us
