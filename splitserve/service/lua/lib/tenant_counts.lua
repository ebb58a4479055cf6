-- A tenant's queue counts, beside the stack's in the admission hash: 'requests@<tenant>' and
-- 'tokens@<tenant>' (tenants.py). The tenant is the part of a request's id before '~' (a tenant's
-- ids are kept as <tenant>~<id>), read from its request hash's key: its counts come back even when
-- the hash itself is gone. A count that comes to zero (or below) is removed.
-- admission: the admission hash; req: the request hash's key; requests, tokens: what to add.
local function tenant_add(admission, req, requests, tokens)
  local tenant = string.match(req, ':req:([^~]+)~')
  if not tenant then return end
  for f, d in pairs({['requests@' .. tenant] = requests, ['tokens@' .. tenant] = tokens}) do
    if redis.call('HINCRBY', admission, f, d) <= 0 then redis.call('HDEL', admission, f) end
  end
end
