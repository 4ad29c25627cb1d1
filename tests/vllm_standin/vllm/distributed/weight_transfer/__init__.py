"""Stand-in for vllm.distributed.weight_transfer: the NCCL weight-transfer engine's trainer and worker ends, with a
gloo group on the CPU in place of NCCL (the rendezvous, the packing and the order of collectives are vLLM's)."""
