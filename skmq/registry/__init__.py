"""Recipients: registration and address checks, the weighted balance, heartbeats."""
