"""Block-Attention (seed ``002``): retrieved passages' KV computed once, cached by content,
and reused at any position of a later prompt, its keys moved to their new positions."""
