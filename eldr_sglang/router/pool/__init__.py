"""The workers: pool and health, circuit breakers, the upstream HTTP client."""
