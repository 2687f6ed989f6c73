"""Training on many processes through torch.distributed: launch, parallelize, keep replicas consistent.

- :mod:`.launch`: torchrun's elastic agent starts the workers (``entrenar train --nproc-per-node N``).
- :mod:`.world`: a worker's rank, world size and process group (gloo on the CPU, NCCL on CUDA).
- :mod:`.steps`: the global batch and each rank's share of a step, so 1 and N processes optimise alike.
- :mod:`.parallelize`: DDP or FSDP2 applied to the plain model from outside.
- :mod:`.consistency`: the replica check (identical trainable weights and optimizer state on every rank).
- :mod:`.state`: full (gathered) state of a sharded model for checkpoints and outputs.

Nothing is imported here: ``entrenar.distributed.launch`` is read by the CLI before torch is.
"""
