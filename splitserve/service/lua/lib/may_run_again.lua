-- A request_id may be sent again (as a new attempt) once its latest attempt has ended without
-- finishing and without an Abort: it failed, or it was cancelled by its client going away or by
-- its deadline. A nil state is an attempt whose hash expired: it has ended. An aborted one stays
-- ended, and a finished one never runs twice (the router answers with its recorded result).
-- The states are splitserve.service.redis_state.MAY_RUN_AGAIN (a test checks they agree).
local function may_run_again(state, aborted)
  return not state or (not aborted and (state == 'failed' or state == 'cancelled'))
end
