"""kmesh.service — the cache-service process and its one client (DESIGN §2 `service`, write-up §22).

protocol (frames, schema, validation) · errors (typed, with wire codes) · identity (SO_PEERCRED, pidfd, token)
· descriptor (layout descriptor until KVLayout) · handles (memfd/SCM_RIGHTS, CUDA IPC) · registry (THE
lifecycle state machine) · jobs (accepted copies, reservations) · store (shared originals) · server (the
process) · client (the one client) · process (start/stop) · worker (a scriptable client process) · cli.
Import the submodule you need; this package imports nothing heavy (clients stay torch-free).
"""
