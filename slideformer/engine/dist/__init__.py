"""Training on several GPUs: of one host (``train.gpus``), and past one host (FSDP2 export)."""
