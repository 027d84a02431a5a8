"""Text generation for the Chat page and ``slideformer chat``: a KV-cache decoder over the
engine's own layer maths, resident or streamed through the sliding window."""
