-- One namespace's novelty memory in Redis (app/memory/redis_vectors.py). Redis runs a script
-- alone, on the node that holds the namespace's keys (they share its hash tag), so each run
-- is one step of the namespace's single order: its search and its adds see no other request.
--
-- KEYS[1]  the namespace's hash: capacity, ttl_ms, model, first, next, adds, evictions,
--          last_t, mode ('flat', 'building': the HNSW index fills meanwhile, 'hnsw'), sweep
--          (entries from sweep to first are cleared but their keys not deleted yet)
-- ARGV[1]  the operation: 'step', 'import', 'read', 'stats', 'clear', 'sweep'
-- ARGV[2]  the entries' key prefix ('<prefix>{ns}:e:'; an entry is <that><seq>, a hash of
--          v (float32 bytes), trace, t (Redis's clock in ms when added), seq)
-- ARGV[3]  the FLAT index's name   ARGV[4]  the HNSW index's name
-- ARGV[5]  capacity   ARGV[6]  TTL in ms ('0': none)   ARGV[7]  model identity ('': none)
-- ARGV[8]  dimensions   ARGV[9]  entries from which HNSW answers ('0': never)
-- ARGV[10] HNSW M   ARGV[11] HNSW EF_CONSTRUCTION   ARGV[12] HNSW EF_RUNTIME
-- ARGV[13] candidates a search returns at first   ARGV[14] '1': may create the namespace
-- ARGV[15..] the operation's own (below)
--
-- Replies start with 'ok', or are {'settings_mismatch', why} (nothing changed) or {'absent'}
-- (no such namespace and ARGV[14] is not '1'; nothing changed).
local meta = KEYS[1]
local op, prefix, flat_idx, hnsw_idx = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local capacity, ttl, model = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local dims, hnsw_from = ARGV[8], tonumber(ARGV[9])
local ef_runtime, first_k = ARGV[12], tonumber(ARGV[13])
-- Candidates whose float32 distance is this close to the best are all returned: Python
-- rescores them in float64 (the reference's arithmetic), so the exact answer is among them.
local MARGIN = 1e-4
-- Keys of cleared entries deleted by a clear or sweep run, and by any other run on the side:
-- a clear of a large namespace holds its node a batch at a time, not all at once.
local CLEAR_BATCH, SWEEP_ON_THE_SIDE = 10000, 100

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- FT.INFO's value for `field` (its names are status replies: tables in Lua).
local function info_of(index, field)
  local info = redis.call('FT.INFO', index)
  for i = 1, #info, 2 do
    local name = info[i]
    if type(name) == 'table' then
      name = name['ok']
    end
    if name == field then
      return info[i + 1]
    end
  end
  return nil
end

local function create_index(name, algorithm)
  local params
  if algorithm == 'FLAT' then
    params = {'6', 'TYPE', 'FLOAT32', 'DIM', dims, 'DISTANCE_METRIC', 'COSINE'}
  else
    params = {'10', 'TYPE', 'FLOAT32', 'DIM', dims, 'DISTANCE_METRIC', 'COSINE',
      'M', ARGV[10], 'EF_CONSTRUCTION', ARGV[11]}
  end
  local ok, err = pcall(redis.call, 'FT.CREATE', name, 'ON', 'HASH', 'PREFIX', '1', prefix,
    'SCHEMA', 'seq', 'NUMERIC', 'v', 'VECTOR', algorithm, unpack(params))
  if not ok and not string.find(tostring(err), 'already exists') then
    error(err)
  end
end

if op == 'stats' or op == 'read' or op == 'clear' or op == 'sweep' then
  if redis.call('EXISTS', meta) == 0 then
    return {'absent'}
  end
end

local state = redis.call('HMGET', meta, 'capacity', 'ttl_ms', 'model', 'first', 'next',
  'mode', 'last_t', 'sweep')
local created = 0
if not state[1] then
  if ARGV[14] ~= '1' then
    return {'absent'}
  end
  redis.call('HSET', meta, 'capacity', ARGV[5], 'ttl_ms', ARGV[6], 'model', model,
    'first', 0, 'next', 0, 'adds', 0, 'evictions', 0, 'last_t', 0, 'mode', 'flat')
  create_index(flat_idx, 'FLAT')
  state = {ARGV[5], ARGV[6], model, '0', '0', 'flat', '0'}
  created = 1
elseif op ~= 'clear' and op ~= 'sweep' then
  if tonumber(state[1]) ~= capacity or tonumber(state[2]) ~= ttl then
    return {'settings_mismatch', 'the shared cache has KP_CACHE_CAPACITY=' .. state[1] ..
      ' and KP_CACHE_TTL_MS=' .. state[2] .. ' (0: unset), this replica ' .. ARGV[5] ..
      ' and ' .. ARGV[6]}
  end
  if model ~= '' then
    if state[3] == '' then
      redis.call('HSET', meta, 'model', model)
    elseif state[3] ~= model then
      return {'settings_mismatch', 'the shared cache holds vectors of ' .. state[3] ..
        ', this replica makes them with ' .. model}
    end
  end
end
local first, next_seq, mode = tonumber(state[4]), tonumber(state[5]), state[6]
local first_at_start, mode_at_start = first, mode
local last_t = tonumber(state[7]) or 0
local sweep = tonumber(state[8]) or first
local sweep_at_start = sweep

-- Deletes up to `count` keys of cleared entries (from sweep on).
local function swept(count)
  local stop = math.min(first, sweep + count)
  for seq = sweep, stop - 1 do
    redis.call('DEL', prefix .. seq)
  end
  sweep = stop
end
if sweep < first and op ~= 'clear' and op ~= 'sweep' then
  swept(SWEEP_ON_THE_SIDE)
end
local mem_capacity = tonumber(state[1])

-- Entries added at or before now - ttl have expired (the reference keeps addedAt > cutoff).
-- Times only grow with seq, so the expired ones are the oldest.
local mem_ttl = tonumber(state[2])
if mem_ttl > 0 then
  while first < next_seq do
    local t = tonumber(redis.call('HGET', prefix .. first, 't'))
    if t and t > now - mem_ttl then
      break
    end
    redis.call('DEL', prefix .. first)
    first = first + 1
  end
end

-- The HNSW index answers once Redis has indexed every entry into it; FLAT until then.
if mode == 'building' and tonumber(info_of(hnsw_idx, 'indexing')) == 0 then
  mode = 'hnsw'
  redis.call('FT.DROPINDEX', flat_idx)
end

local added, evicted = 0, 0
local function add(trace, vector, t)
  redis.call('HSET', prefix .. next_seq, 'v', vector, 'trace', trace, 't', t, 'seq', next_seq)
  next_seq = next_seq + 1
  added = added + 1
  last_t = t
  if next_seq - first > mem_capacity then
    redis.call('DEL', prefix .. first)
    first = first + 1
    evicted = evicted + 1
  end
end

local function evictions_total()
  return tonumber(redis.call('HGET', meta, 'evictions'))
end

-- Writes the namespace's state back when a step changed it (a dry run that expired nothing
-- writes nothing: no AOF write, no fsync).
local function save()
  if added > 0 or first ~= first_at_start then
    redis.call('HSET', meta, 'first', first, 'next', next_seq, 'last_t', last_t)
  end
  if added > 0 then
    redis.call('HINCRBY', meta, 'adds', added)
  end
  if evicted > 0 then
    redis.call('HINCRBY', meta, 'evictions', evicted)
  end
  if mode == 'flat' and hnsw_from > 0 and next_seq - first >= hnsw_from then
    create_index(hnsw_idx, 'HNSW')
    mode = 'building'
  end
  if mode ~= mode_at_start then
    redis.call('HSET', meta, 'mode', mode)
  end
  if sweep ~= sweep_at_start then
    redis.call('HSET', meta, 'sweep', sweep)
  end
end

-- The stored entries nearest `vector` among those with seq >= lo: {method, count, seq,
-- trace, t, v, ...}. The search widens until every entry it finds within MARGIN of the best
-- is in (ties included: the newest copy of a repeated trace must be there).
local function search(vector, lo)
  local exact = mode ~= 'hnsw'
  local index, knn = flat_idx, ' AS d]'
  if not exact then
    index, knn = hnsw_idx, ' EF_RUNTIME ' .. ef_runtime .. ' AS d]'
  end
  local filter = '*'
  if lo > first or sweep < first then  -- cleared entries may linger in the index
    filter = '@seq:[' .. lo .. ' +inf]'
  end
  local live = next_seq - lo
  local k = math.min(first_k, live)
  while true do
    local found = redis.call('FT.SEARCH', index, filter .. '=>[KNN ' .. k .. ' @v $q' .. knn,
      'PARAMS', '2', 'q', vector, 'SORTBY', 'd', 'LIMIT', '0', tostring(k),
      'RETURN', '5', 'd', 'seq', 'trace', 't', 'v', 'DIALECT', '2')
    local n = (#found - 1) / 2
    local wider = false
    if n == k and k < live then
      local best, worst = nil, nil
      local fields = found[3]
      for j = 1, #fields, 2 do
        if fields[j] == 'd' then best = tonumber(fields[j + 1]) end
      end
      fields = found[#found]
      for j = 1, #fields, 2 do
        if fields[j] == 'd' then worst = tonumber(fields[j + 1]) end
      end
      wider = worst - best <= MARGIN
    end
    if not wider then
      local out = {exact and 'exact' or 'index', n}
      for j = 3, #found, 2 do
        local fields, named = found[j], {}
        for f = 1, #fields, 2 do
          named[fields[f]] = fields[f + 1]
        end
        out[#out + 1] = named['seq']
        out[#out + 1] = named['trace']
        out[#out + 1] = named['t']
        out[#out + 1] = named['v']
      end
      return out
    end
    k = math.min(k * 4, live)
  end
end

if op == 'step' then
  -- ARGV[15] '1': add each vector after its search; ARGV[16..] trace id, vector (pairs).
  -- Without adding, vector i (from 0) is compared with the memory less the i oldest entries
  -- that adding the earlier ones would have evicted (Python compares it with those).
  local adding = ARGV[15] == '1'
  local results = {}
  for i = 16, #ARGV, 2 do
    local lo, size = first, next_seq - first
    if not adding then
      local pending = (i - 16) / 2
      lo = first + math.max(0, size + pending - mem_capacity)
    end
    if next_seq - lo > 0 then
      results[#results + 1] = {size, unpack(search(ARGV[i + 1], lo))}
    else
      results[#results + 1] = {size, 'exact', 0}
    end
    if adding then
      add(ARGV[i], ARGV[i + 1], now)
    end
  end
  save()
  return {'ok', now, created, next_seq - first, results, evictions_total()}
end

if op == 'import' then
  -- ARGV[15..] trace id, added_at_ms, vector (triples), appended in order as the newest. An
  -- entry past the TTL is skipped; a time is raised to the newest entry's (times only grow)
  -- and lowered to now (an entry from the future would outlive its TTL).
  local skipped = 0
  for i = 15, #ARGV, 3 do
    local t = math.floor(tonumber(ARGV[i + 1]))
    if mem_ttl > 0 and t <= now - mem_ttl then
      skipped = skipped + 1
    else
      if t > now then t = now end
      if t < last_t then t = last_t end
      add(ARGV[i], ARGV[i + 2], t)
    end
  end
  save()
  return {'ok', now, created, next_seq - first, added, skipped, evictions_total()}
end

if op == 'read' then
  -- ARGV[15] the first seq wanted, ARGV[16] how many: {'ok', now, the seq to ask for next,
  -- the next seq to be added, trace, t, v, ...} oldest first.
  local from = math.max(tonumber(ARGV[15]), first)
  local stop = math.min(from + tonumber(ARGV[16]), next_seq)
  local out = {'ok', now, stop, next_seq}
  for seq = from, stop - 1 do
    local entry = redis.call('HMGET', prefix .. seq, 'trace', 't', 'v')
    if entry[3] then
      out[#out + 1] = entry[1]
      out[#out + 1] = entry[2]
      out[#out + 1] = entry[3]
    end
  end
  save()
  return out
end

if op == 'stats' then
  save()
  local counters = redis.call('HMGET', meta, 'adds', 'evictions')
  local oldest, newest, entry_bytes, index_mb = false, false, 0, '0'
  if next_seq > first then
    oldest = redis.call('HGET', prefix .. first, 't')
    newest = redis.call('HGET', prefix .. (next_seq - 1), 't')
    entry_bytes = redis.call('MEMORY', 'USAGE', prefix .. (next_seq - 1)) or 0
  end
  -- Redis's own bytes: the entries (as the newest one weighs) and the vector index.
  index_mb = info_of(mode == 'hnsw' and hnsw_idx or flat_idx, 'vector_index_sz_mb') or '0'
  return {'ok', now, next_seq - first, state[1], state[2], counters[1], counters[2], oldest,
    newest, entry_bytes, index_mb}
end

if op == 'clear' then
  -- Every entry goes at once for every request after this run (the namespace's first is its
  -- next); their keys are deleted CLEAR_BATCH a run, here and by 'sweep' runs. This replica's
  -- settings become the namespace's (the way to change them), and the namespace answers by
  -- FLAT again. Seqs keep growing. Returns {'ok', now, dropped, keys left to delete}.
  local dropped = next_seq - first
  if sweep >= first then
    sweep = first
  end
  first = next_seq
  swept(CLEAR_BATCH)
  if mode ~= 'flat' then
    pcall(redis.call, 'FT.DROPINDEX', hnsw_idx)
    create_index(flat_idx, 'FLAT')
  end
  redis.call('HSET', meta, 'first', first, 'sweep', sweep, 'capacity', ARGV[5], 'ttl_ms',
    ARGV[6], 'model', model, 'mode', 'flat')
  return {'ok', now, dropped, first - sweep}
end

if op == 'sweep' then
  -- The next CLEAR_BATCH keys of cleared entries: {'ok', now, keys left to delete}.
  swept(CLEAR_BATCH)
  redis.call('HSET', meta, 'sweep', sweep)
  return {'ok', now, first - sweep}
end

return redis.error_reply('unknown operation ' .. op)
