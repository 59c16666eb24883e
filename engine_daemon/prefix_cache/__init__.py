"""The prefix cache: prompts' KV kept in memory (`memory.MemoryTier`) and on disk (`disk.DiskTier`)."""
