"""Pure-Python bookkeeping: requests, KV blocks, scheduling, the plan contract, the time vocabulary.

Nothing in this package imports torch, reads a clock or uses a global random source: callers pass
`now` and seeds. That is what lets the simulator drive the very same scheduler on a virtual clock.
"""
