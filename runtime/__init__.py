"""The batched runtime: model code over a preallocated KV pool, a continuous-batching scheduler, the sampler."""
