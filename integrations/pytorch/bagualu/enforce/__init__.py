"""Enforcement: the only code that moves a saved activation's bytes (over bgl/enforce.h), the
simulated device's pool, pressure eviction and the plan's issue order."""
