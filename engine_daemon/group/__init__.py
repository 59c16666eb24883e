"""Engine groups: one model sharded over several processes (ranks) on MLX's distributed backend.

Rank 0 is the ordinary engine (the only ZeroMQ front-end socket); every tick it turns what
its scheduler did to the generator into a step plan (`plan`), broadcasts it on the
generation stream (`wire`), and every follower rank applies the same plan to its own
generator (`engine_daemon.scheduling.follower`). `control` wakes idle followers and carries
heartbeats, `watchdog` bounds a hung step, `checksum` catches silent divergence.
"""
