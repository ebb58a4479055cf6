"""What the router and the workers share: settings, Redis state, the KV arena, gRPC plumbing."""
