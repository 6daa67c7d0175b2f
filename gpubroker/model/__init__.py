"""The broker's vocabulary as pure types: the lease lifecycle and its events.

Nothing here does I/O or reads a clock; the store, the broker and the
simulator all use these definitions.
"""
