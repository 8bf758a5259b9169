"""What the model families share: shapes (args), attention with the document layout of packed sequences, RMSNorm,
rotary embeddings, the SwiGLU feed-forward, the mixture of experts, the decoder that stacks a family's blocks, the
output loss, weight init and parameter counts. A family's own folder holds only what is its own."""
