"""The step machinery: the model runner, each sequence's state in a loop, the decode
step's static inputs and CUDA graphs, the sampler, pinned host copies and the staging
ring."""
