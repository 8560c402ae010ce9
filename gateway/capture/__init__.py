"""Capture: every answered call appended to a local log by the serving process (`sink`), stored in SQL by a
writer process of its own (`writer`), in a directory no other process writes (`directory`)."""
