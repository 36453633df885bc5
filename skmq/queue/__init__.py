"""The owner-held queue of one app: its state machine (skmq/lifecycle.py), its deliveries in
the owner's memory, and what survives the owner in Redis (journal.py)."""
