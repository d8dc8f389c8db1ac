"""Lowering passes: each adds one kind of non-compute action to a schedule, in linear time.

The passes are generic: they read only the dependencies of docs/semantics.md, never the name of
the schedule that produced the actions.
"""
