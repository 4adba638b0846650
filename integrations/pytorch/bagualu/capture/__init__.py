"""Capture: the saved-tensor hooks and what one forward records (operator scopes, producers,
the hooks on an unmodified model's operator modules and on OpBlock layers)."""
