"""HTTP front-end of mlx-engined: OpenAI-compatible routes relayed to `engined` over ZeroMQ.

Never imports mlx: it stays light, starts fast and runs on hosts with no accelerator.
"""
