"""Auxiliary model slots beside the one generation model: embedding, transcription, speech.

`slots.AuxiliarySlots` keeps at most one model per kind, loaded on first use on the mlx
thread; `jobs.AuxiliaryQueue` runs their work in bounded slices between scheduler steps.

Adding a kind (as `embedding` does):

1. A module named in `model.KIND_MODULES` that calls `register_loader(kind, loader)` at import;
   `loader(name, path)` returns an `AuxiliaryModel` (kind, name, path, weight_bytes, close(),
   job(args)); the loader may carry `accepts(path) -> bool`.
2. `job(args)` returns an `jobs.AuxiliaryJob`: `prepare()` (client-sized CPU work, on the
   admission pool), `queued()`, `step(budget) -> bool` (a bounded slice of MLX work; set
   `last_slice_tokens`), `finished()`, `result()` (plain msgpack values, arrays as raw
   little-endian float32 bytes).
3. A `CallMethod` (protocol) and its io-thread check in `engine_daemon.calls.auxiliary`, which
   returns an `AuxiliaryRequest(kind, model, args)`; registered as `Thread.AUX` in the CALL table.
4. The preload flag in `flags.PRELOAD_FLAGS` and `add_auxiliary_flags`.
"""
