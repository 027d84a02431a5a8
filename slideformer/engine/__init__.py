"""SlideFormer engine: sliding-layer full fine-tuning of large language models on one GPU."""
__version__ = "0.1.0"
