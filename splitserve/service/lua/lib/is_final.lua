-- Whether a request's state is final: it has ended (a nil state, no request, is not final).
-- The states are splitserve.service.redis_state.FINAL_STATES (a test checks they agree).
local function is_final(s) return s == 'finished' or s == 'cancelled' or s == 'failed' end
