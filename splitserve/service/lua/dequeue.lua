-- KEYS[1] admission, KEYS[2] the request hash; ARGV[1] prompt tokens. Returns 1 if it returned them.
-- include: tenant_counts
-- include: leave_local

return leave_local(KEYS[1], KEYS[2], tonumber(ARGV[1]))
