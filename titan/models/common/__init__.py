"""What the model families share: shapes (args), attention with the document layout of packed sequences, RMSNorm,
rotary embeddings, the SwiGLU feed-forward, the mixture of experts, the pre-norm block, the decoder that stacks a
family's blocks, the output loss, weight init, how a job's options make a flavor's args, and parameter counts. A
family's own folder holds only what is its own."""
