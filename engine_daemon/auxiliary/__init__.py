"""Auxiliary model slots beside the one generation model: embedding, transcription, speech.

`slots.AuxiliarySlots` keeps at most one model per kind, loaded on first use on the mlx
thread; `jobs.AuxiliaryQueue` runs their work in bounded slices between scheduler steps.
"""
