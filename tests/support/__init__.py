"""Helpers shared by the tests: spawning gloo ranks (``dist``), tiny models and references (``models``).

``tests/`` is on the import path (pytest puts a root ``conftest.py``'s folder there), so tests
write ``from support.dist import run_ranks``.
"""
