"""Router: validates, tokenizes, admits through Redis, and relays tokens from a decode worker."""
