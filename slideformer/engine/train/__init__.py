"""Training: the Trainer (setup / train / save_checkpoint / cleanup), schedules, checkpoints."""
