"""The worker process (DESIGN.md "Processes"): the engine behind a queue.

`protocol` is the only contract with the GUI (frozen, versioned messages); `loop` is the
worker's request loop over the engine's generator API; `telemetry` sends live Stats at
4 Hz; `entry` is the spawn target; `client` is the torch-free client side that front-ends
(the GUI, the terminal chat, the server) use; `standby` starts a worker ahead of need and `warm_up`
is what it imports meanwhile; `tuned` reads a loaded model's stored tune for the `auto` defaults.

`protocol`, `entry` and `client` never import torch (the GUI imports them); `loop` and
`telemetry` run in the worker. May import every engine layer below it, never `bench`.
"""
