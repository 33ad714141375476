-- One namespace's novelty memory in Redis (app/memory/redis_vectors.py). Redis runs a script
-- alone, on the node that holds the namespace's keys (they share its hash tag), so each run
-- is one step of the namespace's single order: its search and its adds see no other request.
--
-- KEYS[1]  the namespace's hash: capacity, ttl_ms, model, first, next, adds, evictions,
--          last_t, mode ('flat', 'building': the HNSW index fills meanwhile, 'hnsw'), sweep
--          (entries from sweep to first are cleared or expired but their keys not deleted
--          yet), rebuilding (an index made again while Redis indexes the entries into it),
--          hnsw_foreign (why the HNSW index's name is taken by another index: FLAT answers)
-- ARGV[1]  the operation: 'step', 'import', 'read', 'stats', 'clear', 'sweep', 'retire'
-- ARGV[2]  the entries' key prefix ('<prefix>{ns}:e:'; an entry is <that><seq>, a hash of
--          v (float32 bytes), trace, t (Redis's clock in ms when added), seq)
-- ARGV[3]  the FLAT index's name   ARGV[4]  the HNSW index's name
-- ARGV[5]  capacity   ARGV[6]  TTL in ms ('0': none)   ARGV[7]  model identity ('': none)
-- ARGV[8]  dimensions   ARGV[9]  entries from which HNSW answers ('0': never)
-- ARGV[10] HNSW M   ARGV[11] HNSW EF_CONSTRUCTION   ARGV[12] HNSW EF_RUNTIME
-- ARGV[13] candidates a search returns at first   ARGV[14] '1': may create the namespace
-- ARGV[15] '1': check that the indexes are this memory's (FT.INFO), before a step
-- ARGV[16..] the operation's own (below)
--
-- Replies start with 'ok', or are {'settings_mismatch', why} (nothing changed), {'absent'}
-- (no such namespace and ARGV[14] is not '1'; nothing changed), {'foreign_index', index,
-- why} (an index of that name is not this memory's: it is never searched) or
-- {'index_rebuilding', index, made} (the index was missing: made again, `made` 1 by this run,
-- and Redis indexes the entries into it; the namespace answers once it has). A step refused
-- for its index added nothing, but for the earlier traces of its request when the index went
-- between them (their entries are kept).
local meta = KEYS[1]
local op, prefix, flat_idx, hnsw_idx = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local capacity, ttl, model = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local dims, hnsw_from = ARGV[8], tonumber(ARGV[9])
local ef_runtime, first_k = ARGV[12], tonumber(ARGV[13])
local check = ARGV[15] == '1'
-- Candidates whose float32 distance is this close to the best are all returned: Python
-- rescores them in float64 (the reference's arithmetic), so the exact answer is among them.
local MARGIN = 1e-4
-- Keys of cleared entries deleted by a clear or sweep run, and by any other run on the side:
-- a clear of a large namespace holds its node a batch at a time, not all at once.
local CLEAR_BATCH, SWEEP_ON_THE_SIDE = 10000, 100

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- A reply's name or value as a string (names may be status replies: tables in Lua).
local function text(value)
  if type(value) == 'table' and value['ok'] then
    return value['ok']
  end
  return tostring(value)
end

-- A flat {name, value, ...} reply as a table, its names in lower case.
local function fields_of(list)
  local out = {}
  if type(list) ~= 'table' then
    return out
  end
  for i = 1, #list - 1, 2 do
    out[string.lower(text(list[i]))] = list[i + 1]
  end
  return out
end

-- FT.INFO's fields, or nil when there is no such index.
local function info(index)
  local ok, reply = pcall(redis.call, 'FT.INFO', index)
  if not ok then
    return nil
  end
  return fields_of(reply)
end

-- FT.INFO's value for `field` ('0' when there is no such index).
local function info_of(index, field)
  local found = info(index)
  if found == nil or found[field] == nil then
    return '0'
  end
  return found[field]
end

-- Why `index` is not the one this memory makes ('missing' when there is none), or nil: the
-- keys, the prefix, the vector field's algorithm, type, dimension and metric, and seq. A
-- value Redis does not report is not held against it.
local function foreign(index, algorithm)
  local found = info(index)
  if found == nil then
    return 'missing'
  end
  local definition = fields_of(found['index_definition'])
  if definition['key_type'] and text(definition['key_type']) ~= 'HASH' then
    return 'it indexes ' .. text(definition['key_type']) .. ' keys, not hashes'
  end
  local prefixes = definition['prefixes']
  if type(prefixes) == 'table' and (#prefixes ~= 1 or text(prefixes[1]) ~= prefix) then
    local names = {}
    for i = 1, #prefixes do
      names[#names + 1] = text(prefixes[i])
    end
    return 'its key prefix is ' .. table.concat(names, ' ') .. ', not ' .. prefix
  end
  local vector, seq = nil, nil
  if type(found['attributes']) == 'table' then
    for _, attribute in ipairs(found['attributes']) do
      local a = fields_of(attribute)
      local name = a['identifier'] and text(a['identifier'])
      if name == 'v' then
        vector = a
      elseif name == 'seq' then
        seq = a
      end
    end
  end
  if vector == nil or text(vector['type']) ~= 'VECTOR' then
    return 'it has no vector field v'
  end
  local expected = {algorithm = algorithm, data_type = 'FLOAT32', dim = dims,
    distance_metric = 'COSINE'}
  for _, key in ipairs({'algorithm', 'data_type', 'dim', 'distance_metric'}) do
    if vector[key] ~= nil and string.upper(text(vector[key])) ~= expected[key] then
      return 'its ' .. string.gsub(key, '_', ' ') .. ' is ' .. text(vector[key]) ..
        ', not ' .. expected[key]
    end
  end
  if seq == nil or text(seq['type']) ~= 'NUMERIC' then
    return 'it has no numeric field seq'
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
  redis.call('FT.CREATE', name, 'ON', 'HASH', 'PREFIX', '1', prefix,
    'SCHEMA', 'seq', 'NUMERIC', 'v', 'VECTOR', algorithm, unpack(params))
end

-- The index made when missing: 'made', 'ours' (there already, this memory's), or why it is
-- another's.
local function ensure_index(name, algorithm)
  local why = foreign(name, algorithm)
  if why == 'missing' then
    create_index(name, algorithm)
    return 'made'
  end
  return why or 'ours'
end

if op == 'stats' or op == 'read' or op == 'clear' or op == 'sweep' or op == 'retire' then
  if redis.call('EXISTS', meta) == 0 then
    return {'absent'}
  end
end

local state = redis.call('HMGET', meta, 'capacity', 'ttl_ms', 'model', 'first', 'next',
  'mode', 'last_t', 'sweep', 'rebuilding', 'hnsw_foreign')
local created = 0
if not state[1] then
  if ARGV[14] ~= '1' then
    -- A namespace refused for another's index stays refused while that index is there.
    local why = check and foreign(flat_idx, 'FLAT')
    if why and why ~= 'missing' then
      return {'foreign_index', flat_idx, why}
    end
    return {'absent'}
  end
  -- An index of this name made by someone else is never used: nothing is created.
  local flat = ensure_index(flat_idx, 'FLAT')
  if flat ~= 'made' and flat ~= 'ours' then
    return {'foreign_index', flat_idx, flat}
  end
  redis.call('HSET', meta, 'capacity', ARGV[5], 'ttl_ms', ARGV[6], 'model', model,
    'first', 0, 'next', 0, 'adds', 0, 'evictions', 0, 'last_t', 0, 'mode', 'flat')
  state = {ARGV[5], ARGV[6], model, '0', '0', 'flat', '0'}
  created = 1
elseif op ~= 'clear' and op ~= 'sweep' and op ~= 'retire' then
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
local rebuilding, hnsw_foreign = state[9], state[10]

-- Deletes up to `count` keys of cleared or expired entries (from sweep on).
local function swept(count)
  local stop = math.min(first, sweep + count)
  for seq = sweep, stop - 1 do
    redis.call('DEL', prefix .. seq)
  end
  sweep = stop
end
local mem_capacity = tonumber(state[1])

-- Entries added at or before now - ttl have expired (the reference keeps addedAt > cutoff).
-- Times only grow with seq, so the expired ones are a prefix: its end is found by doubling
-- then halving (a few HGETs however many expired), and their keys join the cleared ones,
-- deleted a batch at a time (searches leave them out meanwhile).
local mem_ttl = tonumber(state[2])
if mem_ttl > 0 and first < next_seq then
  local cutoff = now - mem_ttl
  local function expired(seq)
    local t = tonumber(redis.call('HGET', prefix .. seq, 't'))
    return not t or t <= cutoff
  end
  if expired(first) then
    local lo, step = first, 1  -- lo: the last seq known to have expired
    local hi = next_seq  -- the first seq known not to have (or next_seq)
    while lo + step < next_seq and expired(lo + step) do
      lo = lo + step
      step = step * 2
    end
    hi = math.min(next_seq, lo + step)
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if expired(mid) then
        lo = mid
      else
        hi = mid
      end
    end
    if sweep >= first then
      sweep = first
    end
    first = hi
  end
end
if sweep < first and op ~= 'clear' and op ~= 'sweep' and op ~= 'retire' then
  swept(SWEEP_ON_THE_SIDE)
end

-- The HNSW index answers once Redis has indexed every entry into it; FLAT until then. One
-- dropped meanwhile is made again.
if mode == 'building' then
  local found = info(hnsw_idx)
  if found == nil then
    create_index(hnsw_idx, 'HNSW')
  elseif tonumber(text(found['indexing'])) == 0 then
    mode = 'hnsw'
    pcall(redis.call, 'FT.DROPINDEX', flat_idx)
  end
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
  if mode == 'flat' and hnsw_from > 0 and next_seq - first >= hnsw_from and not hnsw_foreign then
    local hnsw = ensure_index(hnsw_idx, 'HNSW')
    if hnsw == 'made' or hnsw == 'ours' then
      mode = 'building'
    else  -- another's index has the name: FLAT goes on answering (until a clear)
      hnsw_foreign = hnsw_idx .. ': ' .. hnsw
      redis.call('HSET', meta, 'hnsw_foreign', hnsw_foreign)
    end
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
    local ok, found = pcall(redis.call, 'FT.SEARCH', index,
      filter .. '=>[KNN ' .. k .. ' @v $q' .. knn, 'PARAMS', '2', 'q', vector, 'SORTBY', 'd',
      'LIMIT', '0', tostring(k), 'RETURN', '5', 'd', 'seq', 'trace', 't', 'v', 'DIALECT', '2')
    if not ok then
      return nil, found
    end
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

-- Whether the index a step searches may be searched: nil, or the reply that refuses the
-- step. A missing one is made again (Redis indexes the stored entries into it, in the
-- background; the namespace answers once it has); another's is never searched.
local function refusal()
  local index, algorithm = flat_idx, 'FLAT'
  if mode == 'hnsw' then
    index, algorithm = hnsw_idx, 'HNSW'
  end
  local found = ensure_index(index, algorithm)
  local made = 0
  if found == 'made' then
    made = 1
    rebuilding = index
    redis.call('HSET', meta, 'rebuilding', index)
  elseif found ~= 'ours' then
    return {'foreign_index', index, found}
  end
  if rebuilding then
    if tonumber(text(info_of(index, 'indexing'))) ~= 0 then
      return {'index_rebuilding', index, made}
    end
    redis.call('HDEL', meta, 'rebuilding')
    rebuilding = nil
  end
  return nil
end

if op == 'step' then
  -- ARGV[16] '1': add each vector after its search; ARGV[17] a receipt's key ('': none) and
  -- ARGV[18] its TTL in ms; ARGV[19..] trace id, vector (pairs). With a receipt, the step's
  -- results are kept under it with the adds, and a step that finds it kept adds nothing and
  -- answers them again (a retry whose first answer was lost).
  -- Without adding, vector i (from 0) is compared with the memory less the i oldest entries
  -- that adding the earlier ones would have evicted (Python compares it with those).
  local receipt = ARGV[17] or ''
  if receipt ~= '' then
    local kept = redis.call('GET', receipt)
    if kept then
      local r = cjson.decode(kept)
      return {'ok', r[1], created, next_seq - first, r[2], evictions_total(), hnsw_foreign or ''}
    end
  end
  if check or rebuilding then
    local refused = refusal()
    if refused then
      save()
      return refused
    end
  end
  local adding = ARGV[16] == '1'
  local results = {}
  for i = 19, #ARGV, 2 do
    local lo, size = first, next_seq - first
    if not adding then
      local pending = (i - 19) / 2
      lo = first + math.max(0, size + pending - mem_capacity)
    end
    if next_seq - lo > 0 then
      local found, err = search(ARGV[i + 1], lo)
      -- No answer, or none from a namespace that holds entries: is the index still ours?
      if found == nil or found[2] == 0 then
        local refused = refusal()
        if refused then
          save()
          return refused
        end
        if found == nil then
          error(err)
        end
      end
      results[#results + 1] = {size, unpack(found)}
    else
      results[#results + 1] = {size, 'exact', 0}
    end
    if adding then
      add(ARGV[i], ARGV[i + 1], now)
    end
  end
  save()
  if adding and receipt ~= '' then
    -- Numbers as text: cjson keeps 14 digits, and a time in ms has more.
    local kept = {}
    for j, result in ipairs(results) do
      kept[j] = {}
      for k, field in ipairs(result) do
        kept[j][k] = type(field) == 'number' and string.format('%.17g', field) or field
      end
    end
    redis.call('SET', receipt, cjson.encode({string.format('%.17g', now), kept}), 'PX', ARGV[18])
  end
  return {'ok', now, created, next_seq - first, results, evictions_total(), hnsw_foreign or ''}
end

if op == 'import' then
  -- ARGV[16..] trace id, added_at_ms, vector (triples), appended in order as the newest. An
  -- entry past the TTL is skipped; a time is raised to the newest entry's (times only grow)
  -- and lowered to now (an entry from the future would outlive its TTL).
  local skipped = 0
  for i = 16, #ARGV, 3 do
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
  -- ARGV[16] the first seq wanted, ARGV[17] how many: {'ok', now, the seq to ask for next,
  -- the next seq to be added, trace, t, v, ...} oldest first.
  local from = math.max(tonumber(ARGV[16]), first)
  local stop = math.min(from + tonumber(ARGV[17]), next_seq)
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
  if mode ~= 'flat' and not foreign(hnsw_idx, 'HNSW') then
    redis.call('FT.DROPINDEX', hnsw_idx)
  end
  -- The FLAT index made again when it went; another's of that name is refused at the next
  -- step that checks.
  ensure_index(flat_idx, 'FLAT')
  redis.call('HSET', meta, 'first', first, 'sweep', sweep, 'capacity', ARGV[5], 'ttl_ms',
    ARGV[6], 'model', model, 'mode', 'flat')
  redis.call('HDEL', meta, 'rebuilding', 'hnsw_foreign')
  return {'ok', now, dropped, first - sweep}
end

if op == 'sweep' then
  -- The next CLEAR_BATCH keys of cleared entries: {'ok', now, keys left to delete}.
  swept(CLEAR_BATCH)
  redis.call('HSET', meta, 'sweep', sweep)
  return {'ok', now, first - sweep}
end

if op == 'retire' then
  -- A namespace whose every entry expired (or was cleared) gives its memory back: its
  -- entries' keys deleted CLEAR_BATCH a run, then its indexes (its own only) and its hash.
  -- {'ok', now, 'live', entries, the newest entry's time} (it holds some: nothing done),
  -- {'ok', now, 'sweeping', keys left to delete} or {'ok', now, 'gone'}.
  if first < next_seq then
    save()
    return {'ok', now, 'live', next_seq - first, last_t}
  end
  swept(CLEAR_BATCH)
  if sweep < first then
    save()
    return {'ok', now, 'sweeping', first - sweep}
  end
  if not foreign(flat_idx, 'FLAT') then
    redis.call('FT.DROPINDEX', flat_idx)
  end
  if not foreign(hnsw_idx, 'HNSW') then
    redis.call('FT.DROPINDEX', hnsw_idx)
  end
  redis.call('DEL', meta)
  return {'ok', now, 'gone'}
end

return redis.error_reply('unknown operation ' .. op)
