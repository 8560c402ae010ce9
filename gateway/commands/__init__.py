"""The `kaizen` command line: one module per command, assembled by `gateway.commands.main`.

Commands are tools around the serving path, never part of it: the serving process imports none of them.
"""
