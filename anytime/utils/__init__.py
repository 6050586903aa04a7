"""Small helpers shared by the library: atomic file writes, seeding, machine description."""
