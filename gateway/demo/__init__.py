"""`kaizen demo`: the whole learning loop on this machine, end to end through real HTTP."""
